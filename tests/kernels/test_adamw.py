"""Fused multi-tensor AdamW over flat buffers: reference vs a per-tensor float64 AdamW, kernel vs reference."""
import numpy as np
import pytest
from kernel_utils import DTYPES

from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import adamw as K

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _adamw64(w, g, m, v, t, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW's update, float64."""
    w = w * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    w = w - lr / (1 - beta1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - beta2 ** t) + eps)
    return w, m, v


def _layout(rng, sizes):
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    total = int(np.sum(sizes))
    return offsets, total


def test_reference_matches_float64_adamw_over_three_steps(rng):
    sizes = [5, 1, 17, 3]
    offsets, total = _layout(rng, sizes)
    params = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    w64 = np.concatenate(params).astype(np.float64)
    m, v = np.zeros(total, np.float32), np.zeros(total, np.float32)
    m64, v64 = np.zeros(total), np.zeros(total)
    plan = K.adamw_plan(params, offsets)
    for t in (1, 2, 3):
        grad = rng.standard_normal(total).astype(np.float32)
        K.adamw_step(plan, grad, m, v, step=t, **HP)
        w64, m64, v64 = _adamw64(w64, grad.astype(np.float64), m64, v64, t, **HP)
    np.testing.assert_allclose(np.concatenate(params), w64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, m64, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, v64, rtol=1e-5, atol=1e-9)


def test_bf16_params_with_fp32_master(rng):
    sizes = [4, 9]
    offsets, total = _layout(rng, sizes)
    master = rng.standard_normal(total).astype(np.float32)
    params = [master[o:o + n].astype(DTYPES["bfloat16"]) for o, n in zip(offsets, sizes)]
    m, v, grad = np.zeros(total, np.float32), np.zeros(total, np.float32), rng.standard_normal(total)
    want, _, _ = _adamw64(master.astype(np.float64), grad, 0, 0, 1, **HP)
    K.adamw_step(K.adamw_plan(params, offsets), grad.astype(DTYPES["bfloat16"]), m, v, master=master, step=1,
                 grad_scale=1.0, **HP)
    np.testing.assert_allclose(master, want, rtol=1e-4, atol=1e-5)  # grads were rounded to bf16
    np.testing.assert_array_equal(np.concatenate(params).astype(np.float32),
                                  master.astype(DTYPES["bfloat16"]).astype(np.float32))


def test_grad_scale_divides_gradients(rng):
    p1, p2 = [rng.standard_normal(6).astype(np.float32)], [None]
    p2[0] = p1[0].copy()
    g = rng.standard_normal(6).astype(np.float32)
    m1, v1, m2, v2 = (np.zeros(6, np.float32) for _ in range(4))
    K.adamw_step(K.adamw_plan(p1, [0]), g * 1024, m1, v1, step=1, grad_scale=1 / 1024, **HP)
    K.adamw_step(K.adamw_plan(p2, [0]), g, m2, v2, step=1, **HP)
    np.testing.assert_allclose(p1[0], p2[0], rtol=1e-6)


def test_errors():
    p = [np.zeros(4, DTYPES["bfloat16"])]
    with pytest.raises(DTypeError, match="master"):
        K.adamw_step(K.adamw_plan(p, [0]), np.zeros(4, np.float32), np.zeros(4, np.float32),
                     np.zeros(4, np.float32), step=1, **HP)
    with pytest.raises(ShapeError, match=r"at least 6 elements.*\(4,\)"):
        K.adamw_step(K.adamw_plan([np.zeros(6, np.float32)], [0]), np.zeros(4, np.float32),
                     np.zeros(6, np.float32), np.zeros(6, np.float32), step=1, **HP)
    with pytest.raises(DTypeError, match="parameter 1"):
        K.adamw_plan([np.zeros(2, np.float32), np.zeros(2, np.float16)], [0, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("pdt", ["float32", "bfloat16"])
@pytest.mark.parametrize("gdt", ["float32", "bfloat16"])
def test_kernel_matches_reference(rng, pdt, gdt):
    import cupy as cp

    from flame_core.kernels import launching, loader
    sizes = [1, 7, 16384, 16385, 50000, 3, 3072 * 4 + 5]
    offsets, total = _layout(rng, sizes)
    total += 11  # the flat buffers may be longer than the parameters they hold
    master0 = rng.standard_normal(total).astype(np.float32)
    grads = [rng.standard_normal(total).astype(DTYPES[gdt]) for _ in range(3)]

    def run():
        master = cp.asarray(master0) if pdt != "float32" else None
        params = [cp.asarray(master0[o:o + n].astype(DTYPES[pdt])) for o, n in zip(offsets, sizes)]
        m, v = cp.zeros(total, np.float32), cp.zeros(total, np.float32)
        plan = K.adamw_plan(params, offsets)
        for t, g in enumerate(grads, 1):
            K.adamw_step(plan, cp.asarray(g), m, v, master=master, step=t, grad_scale=0.5, **HP)
        return [cp.asnumpy(p).astype(np.float64) for p in params], cp.asnumpy(m), cp.asnumpy(v)

    before = launching.launches
    pk, mk, vk = run()
    assert launching.launches == before + 3
    with loader.reference():
        pr, mr, vr = run()
    # fp32 moments: the kernel's fused multiply-adds round differently from the reference's separate ops (a few ulps)
    np.testing.assert_allclose(mk, mr, rtol=5e-6, atol=1e-7)
    np.testing.assert_allclose(vk, vr, rtol=5e-6, atol=1e-9)
    tol = 1e-5 if pdt == "float32" else 8e-3
    for a, b in zip(pk, pr):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
