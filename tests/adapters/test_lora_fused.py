"""Fused LoRA (flame_core.ops.linear.linear_low_rank, what an adapted Linear runs for plain LoRAs): the same numbers
as the general path (delta tensors added into the rows), float64 gradients against central differences, bf16
autocast within bf16 rounding, and the cases that must fall back to the general path."""
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn
import flame_nn.adapters as A
from flame_core.autograd.gradcheck import gradcheck
from flame_core.ops import linear as core_linear
from flame_core.ops.linear import linear_low_rank
from flame_nn.adapters.layer import AdaptedLinearMixin


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _layer(rng, n_in, n_out, blocks, rank, bias, device, dtype=flame.float64, adapter_dtype=flame.float64):
    """A Linear with one LoRA per (lo, hi) row block, every parameter random (B too: a zero B hides mistakes)."""
    lin = flame_nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    A.adapt(lin)
    for lo, hi in blocks:
        ad = A.LoRA(n_in, hi - lo, rank=rank, alpha=rank * 0.75, dtype=adapter_dtype, device=device)
        with flame.no_grad():
            ad.lora_B.copy_(flame.tensor(rng.standard_normal((hi - lo, rank)), dtype=adapter_dtype, device=device))
        lin.add_adapter("default", ad, rows=(lo, hi))
    return lin


def _run(lin, x, fused):
    """(y, dx, [dA, dB per adapter], dW, db) of sum(y * r) for a fixed random r, through the fused or general path."""
    lin.fuse_lora = fused
    for p in _params(lin):
        p.grad = None
    x = x.detach().requires_grad_(True)
    y = lin(x)
    r = flame.tensor(np.random.default_rng(9).standard_normal(y.shape), dtype=y.dtype, device=y.device)
    (y * r).sum().backward()
    grads = [_np(p.grad) if p.grad is not None else None for p in _params(lin)]
    return _np(y), _np(x.grad), grads


def _params(lin):
    ads = [ad for entries in lin._adapters.values() for _, ad in entries]
    return [q for ad in ads for q in (ad.lora_A, ad.lora_B)] + [lin.weight] + ([lin.bias] if lin.bias is not None
                                                                               else [])


@st.composite
def _geometry(draw):
    n_in = draw(st.integers(1, 9))
    n_out = draw(st.integers(1, 12))
    cuts = sorted(draw(st.sets(st.integers(0, n_out), min_size=2, max_size=4)))
    blocks = [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if draw(st.booleans()) or lo == cuts[0]]
    lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    return n_in, n_out, blocks, draw(st.integers(1, 3)), draw(st.booleans()), draw(st.booleans()), tuple(lead)


@settings(max_examples=25, deadline=None)
@given(_geometry())
def test_fused_equals_general_path_float64(geometry):
    n_in, n_out, blocks, rank, bias, train_base, lead = geometry
    rng = np.random.default_rng(0)
    lin = _layer(rng, n_in, n_out, blocks, rank, bias, "cpu")
    lin.weight.requires_grad_(train_base)
    if lin.bias is not None:
        lin.bias.requires_grad_(train_base)
    x = flame.tensor(rng.standard_normal(lead + (n_in,)), dtype=flame.float64, device="cpu")
    fy, fdx, fg = _run(lin, x, fused=True)
    gy, gdx, gg = _run(lin, x, fused=False)
    np.testing.assert_allclose(fy, gy, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fdx, gdx, rtol=1e-12, atol=1e-12)
    assert len(fg) == len(gg)
    for a, b in zip(fg, gg):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("geometry", [(7, 13, [(0, 5), (9, 13)], 3, True, (2, 5)),
                                      (33, 96, [(0, 32), (32, 64), (64, 96)], 16, True, (1, 77)),
                                      (48, 40, [(3, 40)], 5, False, (129,))])
def test_fused_equals_general_path_float32(geometry, rng, device):
    """Ragged shapes on the test device (cuBLAS on cuda: row blocks as strided outputs, alpha / beta)."""
    n_in, n_out, blocks, rank, bias, lead = geometry
    lin = _layer(rng, n_in, n_out, blocks, rank, bias, device, dtype=flame.float32, adapter_dtype=flame.float32)
    x = flame.tensor(rng.standard_normal(lead + (n_in,)), dtype=flame.float32, device=device)
    (fy, fdx, fg), (gy, gdx, gg) = _run(lin, x, True), _run(lin, x, False)
    np.testing.assert_allclose(fy, gy, rtol=1e-4, atol=1e-4 * np.abs(gy).max())
    np.testing.assert_allclose(fdx, gdx, rtol=1e-4, atol=1e-4 * np.abs(gdx).max())
    for a, b in zip(fg, gg):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_fused_path_is_taken_and_forms_no_delta(rng):
    lin = _layer(rng, 6, 9, [(0, 3), (6, 9)], 2, True, "cpu")
    x = flame.tensor(rng.standard_normal((4, 6)), dtype=flame.float64, device="cpu")
    with mock.patch.object(core_linear.LinearLowRank, "apply", wraps=core_linear.LinearLowRank.apply) as fused, \
            mock.patch("flame_nn.adapters.layer.add_rows") as add_rows:
        lin(x)
    assert fused.call_count == 1 and add_rows.call_count == 0
    lin.fuse_lora = False
    with mock.patch.object(core_linear.LinearLowRank, "apply", wraps=core_linear.LinearLowRank.apply) as fused:
        lin(x)
    assert fused.call_count == 0


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(2, 7), st.integers(1, 3), st.booleans())
def test_linear_low_rank_gradcheck(n, n_in, rank, bias):
    rng = np.random.default_rng(n * 31 + n_in)
    n_out = 6

    def t(*shape):
        return flame.tensor(rng.standard_normal(shape), dtype=flame.float64, requires_grad=True)
    x, w, b = t(n, n_in), t(n_out, n_in), (t(n_out) if bias else None)
    a1, b1, a2, b2 = t(rank, n_in), t(2, rank), t(rank, n_in), t(3, rank)

    def fn(x, w, a1, b1, a2, b2, *bb):
        return linear_low_rank(x, w, bb[0] if bb else None, [(a1, b1, 0, 2, 0.5), (a2, b2, 3, 6, 1.5)])
    assert gradcheck(fn, (x, w, a1, b1, a2, b2) + ((b,) if bias else ()))


@pytest.mark.parametrize("frozen", [(), (1,), (0, 2)])
def test_adapters_sharing_the_input_with_some_frozen_or_without_a_gradient(rng, device, frozen):
    """The adapters of one layer share its input: their down-projections, dx and dA come from one GEMM each over
    the stacked A_i. A frozen adapter (no dA / dB) and an output part that gets no gradient (its adapter's dA / dB
    are zeros) give the general path's numbers."""
    lin = _layer(rng, 33, 96, [(0, 32), (32, 64), (64, 96)], 4, True, device)
    ads = [ad for entries in lin._adapters.values() for _, ad in entries]
    for i in frozen:
        ads[i].requires_grad_(False)
    x = flame.tensor(rng.standard_normal((2, 9, 33)), dtype=flame.float64, device=device)
    out = {}
    for fused in (True, False):
        lin.fuse_lora = fused
        for p in _params(lin):
            p.grad = None
        xg = x.detach().requires_grad_(True)
        q, k, v = lin.forward_split(xg, (32, 32, 32))
        (q.sum() * 0.5 + (v * v).sum()).backward()         # k's rows get no gradient
        out[fused] = ([p.grad for p in _params(lin)], _np(xg.grad), _np(q), _np(k), _np(v))
    (fg, fdx, *fo), (gg, gdx, *go) = out[True], out[False]
    for a, b in zip(fo, go):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fdx, gdx, rtol=1e-12, atol=1e-12)
    for i, (a, b) in enumerate(zip(fg, gg)):
        assert (a is None) == (b is None), i
        if a is not None:
            np.testing.assert_allclose(_np(a), _np(b), rtol=1e-11, atol=1e-12)
    assert all(fg[2 * i] is None and fg[2 * i + 1] is None for i in frozen)
    if 1 not in frozen:
        assert not _np(fg[2]).any() and not _np(fg[3]).any()   # k's adapter: zeros, no gradient reached it


def test_bf16_autocast_matches_general_path(rng, device):
    lin = _layer(rng, 64, 96, [(0, 32), (32, 64), (64, 96)], 8, True, device, dtype=flame.bfloat16,
                 adapter_dtype=flame.float32)
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    x = flame.tensor(rng.standard_normal((3, 17, 64)), dtype=flame.bfloat16, device=device)
    out = {}
    for fused in (True, False):
        with flame.amp.autocast(str(device).split(":")[0], dtype=flame.bfloat16):
            out[fused] = _run(lin, x, fused)
    (fy, fdx, fg), (gy, gdx, gg) = out[True], out[False]
    scale = np.abs(gy).max()
    assert np.abs(fy - gy).max() <= 2e-2 * scale          # bf16: one rounding of the sum against several
    assert np.abs(fdx - gdx).max() <= 2e-2 * np.abs(gdx).max()
    for a, b in zip(fg[:6], gg[:6]):                       # the adapters' float32 gradients
        assert a.dtype == np.float64 and np.abs(a - b).max() <= 3e-2 * np.abs(b).max()


def test_dropout_and_other_adapters_take_the_general_path(rng):
    lin = flame_nn.Linear(5, 4, dtype=flame.float64)
    A.adapt(lin)
    lin.add_adapter("default", A.LoRA(5, 4, rank=2, dropout=0.5, dtype=flame.float64))
    x = flame.tensor(rng.standard_normal((3, 5)), dtype=flame.float64)
    assert isinstance(lin, AdaptedLinearMixin)
    with mock.patch.object(core_linear.LinearLowRank, "apply", wraps=core_linear.LinearLowRank.apply) as fused:
        lin.train()
        lin(x)
        assert fused.call_count == 0                       # dropout while training: the general path
        lin.eval()
        lin(x)
        assert fused.call_count == 1                       # dropout is off in eval: fused
    dora = flame_nn.Linear(5, 4, dtype=flame.float64)
    A.adapt(dora)
    dora.add_adapter("default", A.DoRA(5, 4, rank=2, dtype=flame.float64, base_weight=dora.weight))
    with mock.patch.object(core_linear.LinearLowRank, "apply", wraps=core_linear.LinearLowRank.apply) as fused:
        dora(x)
    assert fused.call_count == 0


def test_double_backward_is_refused_clearly(rng):
    lin = _layer(rng, 4, 4, [(0, 4)], 2, False, "cpu")
    x = flame.tensor(rng.standard_normal((2, 4)), dtype=flame.float64, requires_grad=True, device="cpu")
    y = lin(x).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        flame.autograd.grad(y, x, create_graph=True)


def test_bad_factors_are_refused():
    x, w = flame.zeros(2, 4), flame.zeros(6, 4)
    with pytest.raises(ValueError, match=r"rows \[4:8\]"):
        linear_low_rank(x, w, None, [(flame.zeros(2, 4), flame.zeros(4, 2), 4, 8, 1.0)])
    with pytest.raises(ValueError, match="do not fit"):
        linear_low_rank(x, w, None, [(flame.zeros(2, 3), flame.zeros(2, 2), 0, 2, 1.0)])
    with pytest.raises(TypeError, match="one dtype"):
        linear_low_rank(x, w, None, [(flame.zeros(2, 4, dtype=flame.float64), flame.zeros(2, 2), 0, 2, 1.0)])
