"""Stochastic rounding to bfloat16 (flame_core.kernels.stochastic_rounding, the optimizer kernels' sr_bf16): each
value lands on one of its two bfloat16 neighbours, up with probability equal to the dropped fraction (unbiased);
the bits depend on the seed, the salt and the element only; inf and NaN pass; a bfloat16 weight under AdamW8bit
takes updates far below its spacing (round-to-nearest would keep it where it was). The GPU kernel's bits are
checked against this path in tests/kernels/test_adamw8bit.py."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flame_core.kernels.stochastic_rounding import sr_bits, to_bf16_stochastic


def _neighbours(x):
    """The bfloat16 values just below and above float32 x (truncation and the next one away from zero)."""
    u = x.view(np.uint32)
    lo = (u >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    hi = ((u >> 16) + 1).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    return lo, hi


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 20), st.integers(0, 2 ** 31))
def test_each_value_lands_on_one_of_its_two_neighbours(n, seed, salt, data_seed):
    x = (np.random.default_rng(data_seed).standard_normal(n) * 10.0 ** np.random.default_rng(data_seed).integers(
        -20, 20, n)).astype(np.float32)
    r = to_bf16_stochastic(x, seed, salt).astype(np.float32)
    lo, hi = _neighbours(x)
    assert ((r == lo) | (r == hi)).all()
    exact = x == lo
    assert (r[exact] == x[exact]).all()          # a value bfloat16 holds stays itself


@pytest.mark.parametrize("frac", [1 / 8, 1 / 2, 0.9])
def test_rounding_is_unbiased(frac):
    step = 2.0 ** -7                              # bfloat16's spacing on [1, 2)
    x = np.full(200_000, 1.0 + frac * step, np.float32)
    r = to_bf16_stochastic(x, seed=11, salt=5).astype(np.float64)
    assert set(np.unique(r)) == {1.0, 1.0 + step}
    assert abs((r.mean() - 1.0) / step - frac) < 0.01
    neg = to_bf16_stochastic(-x, seed=11, salt=5).astype(np.float64)
    assert abs((-neg.mean() - 1.0) / step - frac) < 0.01   # symmetric: the magnitude rounds


def test_the_bits_are_a_function_of_seed_salt_and_index():
    a = sr_bits(3, 7, 1000)
    assert np.array_equal(a, sr_bits(3, 7, 1000)) and np.array_equal(a[:10], sr_bits(3, 7, 10))
    assert (a != sr_bits(4, 7, 1000)).mean() > 0.99 and (a != sr_bits(3, 8, 1000)).mean() > 0.99
    lows = (a & 0xFFFF).astype(np.float64) / 65536
    assert abs(lows.mean() - 0.5) < 0.03            # the 16 bits used: uniform enough


def test_inf_and_nan_pass_unchanged():
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    r = to_bf16_stochastic(x, 1, 2).astype(np.float32)
    assert r[0] == np.inf and r[1] == -np.inf and np.isnan(r[2]) and r[3] == 0 and np.signbit(r[4])


@pytest.mark.parametrize("name", ["AdamW8bit", "Adafactor"])
def test_a_bf16_weight_takes_updates_below_its_spacing(name, device):
    """Each step moves every weight by ~1e-5 (Adam's first steps: lr per element; Adafactor's clipped update: lr
    times its unit RMS), ~1/400 of bf16's spacing at 1: round-to-nearest would keep every weight where it was. On
    the GPU the fused kernels do it (AdamW8bit's, Adafactor's four launches)."""
    import flame_core as flame
    import flame_nn
    w0 = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    p = flame_nn.Parameter(flame.tensor(w0, device=device).to(flame.bfloat16))
    start = p.detach().float().numpy().copy()
    opt = (flame_nn.optim.AdamW8bit([p], lr=1e-5, weight_decay=0.0) if name == "AdamW8bit" else
           flame_nn.optim.Adafactor([p], lr=1e-5, relative_step=False, scale_parameter=False))
    for _ in range(100):
        p.grad = flame.ones_like(p)
        opt.step()
    moved = start - p.detach().float().numpy()
    assert p.dtype == flame.bfloat16
    assert moved.mean() == pytest.approx(100 * 1e-5, rel=0.1)
    rne = flame.tensor(w0, device="cpu").to(flame.bfloat16).float().numpy()
    assert np.array_equal(start, rne)             # (the start is the bf16 weight itself)
