"""Fused multi-tensor AdamW8bit (flame_core.kernels.adamw8bit): the optimizer's fused step against its
per-operation path (the same class inside loader.reference()), bit for bit, and the plan's argument errors."""
import numpy as np
import pytest
from kernel_utils import DTYPES

from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import adamw8bit as K

# sizes around the 256-element blocks; 4095 stays below min_8bit_size (float32 moments), the rest are quantised
SIZES = [1, 255, 256, 257, 4095, 5000, 70001]


def _run(gdt, wd, steps, rng_seed=3, pdt="float32"):
    import flame_core as flame
    import flame_nn as nn
    rng = np.random.default_rng(rng_seed)
    inits = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    params = [nn.Parameter(flame.tensor(a.reshape(1, -1) if n % 2 else a, device="cuda").to(getattr(flame, pdt)))
              for a, n in zip(inits, SIZES)]
    opt = nn.optim.AdamW8bit(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=wd, min_8bit_size=4096)
    for _ in range(steps):
        for p in params:
            g = rng.standard_normal(p.shape) * rng.choice([1e-3, 1.0, 30.0])
            p.grad = flame.tensor(g.astype(DTYPES[gdt]), device="cuda")
        opt.step()
    state = [{k: v.numpy() for k, v in opt.state[p].items() if k != "step"} for p in params]
    return [p.detach().numpy() for p in params], state, [opt.state[p]["step"] for p in params]


@pytest.mark.gpu
@pytest.mark.parametrize("pdt", ["float32", "bfloat16"])   # bfloat16 weights: stochastic rounding, the same bits
@pytest.mark.parametrize("gdt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_fused_step_equals_the_per_operation_path(gdt, wd, pdt):
    from flame_core.kernels import launching, loader
    before = launching.launches
    wk, sk, tk = _run(gdt, wd, steps=3, pdt=pdt)
    assert launching.launches - before >= 3  # the fused kernel ran (once per step)
    with loader.reference():
        before = launching.launches
        wr, sr, tr = _run(gdt, wd, steps=3, pdt=pdt)
        assert launching.launches == before, "the reference path launched a kernel"
    assert tk == tr == [3] * len(SIZES)
    for n, a, b, s, r in zip(SIZES, wk, wr, sk, sr):
        assert set(s) == set(r) == ({"exp_avg", "exp_avg_sq"} | ({"exp_avg_absmax", "exp_avg_sq_absmax"}
                                                               if n >= 4096 else set()))
        np.testing.assert_array_equal(a, b, err_msg=f"weights of the {n}-element tensor")
        for k in s:
            np.testing.assert_array_equal(s[k], r[k], err_msg=f"{k} of the {n}-element tensor")


@pytest.mark.gpu
def test_one_launch_per_step_for_every_tensor():
    import flame_core as flame
    import flame_nn as nn
    from flame_core.kernels import launching
    params = [nn.Parameter(flame.randn(n, device="cuda")) for n in SIZES]
    opt = nn.optim.AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = flame.randn(*p.shape, device="cuda")
    opt.step()  # first step: the state is made (its fills launch kernels of their own)
    for _ in range(2):  # the cached plan: the same single launch
        before = launching.launches
        opt.step()
        assert launching.launches - before == 1
    assert [opt.state[p]["step"] for p in params] == [3] * len(SIZES)


@pytest.mark.gpu
def test_fused_and_per_operation_steps_alternate_safely():
    """A step on the per-operation path replaces the state arrays; the next fused step must not write through the
    cached plan's old addresses: three steps fused / reference / fused equal three reference steps."""
    import flame_core as flame
    import flame_nn as nn
    from flame_core.kernels import loader

    def run(modes):
        rng = np.random.default_rng(7)
        params = [nn.Parameter(flame.tensor(rng.standard_normal(n).astype(np.float32), device="cuda"))
                  for n in SIZES]
        opt = nn.optim.AdamW8bit(params, lr=1e-2)
        for ref in modes:
            for p in params:
                p.grad = flame.tensor(rng.standard_normal(p.shape).astype(np.float32), device="cuda")
            if ref:
                with loader.reference():
                    opt.step()
            else:
                opt.step()
        return [p.detach().numpy() for p in params]
    for a, b in zip(run([False, True, False]), run([True, True, True])):
        np.testing.assert_array_equal(a, b)


def test_table_errors_name_the_tensor_and_field():
    p = np.zeros(300, np.float32)
    q = np.zeros(300, np.uint8)
    with pytest.raises(ShapeError, match="no tensors"):
        K.adamw8bit_table([])
    with pytest.raises(ShapeError, match="tensor 0 has one absmax array of two"):
        K.adamw8bit_table([(p, p, q, q, np.zeros(2, np.float32), None)])
    with pytest.raises(DTypeError, match="tensor 0's exp_avg must be uint8 \\(quantised\\)"):
        K.adamw8bit_table([(p, p, p, q, np.zeros(2, np.float32), np.zeros(2, np.float32))])
    with pytest.raises(DTypeError, match="tensor 0's exp_avg_sq must be float32 \\(float32 moments\\)"):
        K.adamw8bit_table([(p, p, p, q, None, None)])
    with pytest.raises(ShapeError, match="tensor 0's parameter must be on the GPU"):
        K.adamw8bit_table([(p, p, q, q, np.zeros(2, np.float32), np.zeros(2, np.float32))])
