"""Gradient accumulation: N micro-batches (loss / N each) give the gradient of one batch of N, with plain .grad
accumulation, with checkpointed blocks, and through the gradient pool."""

import numpy as np
import pytest

import flame_core as flame


def _batch(device, n, dim, dtype):
    rng = np.random.default_rng(42)
    x = flame.tensor(rng.standard_normal((n, 6, dim)), dtype=dtype, device=device)
    t = flame.tensor(rng.standard_normal((n, 6, dim)), dtype=dtype, device=device)
    return x, t


def _loss(stack, x, t):
    return ((stack(x) - t) ** 2).mean()


def _full_batch_grads(stack, x, t):
    for p in stack.parameters():
        p.grad = None
    _loss(stack, x, t).backward()
    return [p.grad.numpy().copy() for p in stack.parameters()]


def _accumulated_grads(stack, x, t, micro):
    for p in stack.parameters():
        p.grad = None
    n = x.shape[0]
    for i in range(0, n, micro):
        (_loss(stack, x[i:i + micro], t[i:i + micro]) * (micro / n)).backward()
    return [p.grad.numpy().copy() for p in stack.parameters()]


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_sum_to_the_full_batch_gradient_float64(tiny, device, micro):
    st = tiny.Stack(2, 16, 2, device, dtype=flame.float64, seed=1)
    x, t = _batch(device, 8, 16, flame.float64)
    full = _full_batch_grads(st, x, t)
    acc = _accumulated_grads(st, x, t, micro)
    for k, (a, f) in enumerate(zip(acc, full)):
        np.testing.assert_allclose(a, f, rtol=1e-10, atol=1e-13, err_msg=f"param {k}")


def test_accumulation_with_checkpointed_blocks_float32(tiny, device):
    st = tiny.Stack(3, 16, 2, device, dtype=flame.float32, seed=2)
    x, t = _batch(device, 8, 16, flame.float32)
    full = _full_batch_grads(st, x, t)
    st.gradient_checkpointing = True
    acc = _accumulated_grads(st, x, t, 2)
    for k, (a, f) in enumerate(zip(acc, full)):
        np.testing.assert_allclose(a, f, rtol=2e-4, atol=2e-6, err_msg=f"param {k}")


def test_accumulation_through_the_gradient_pool(tiny, device):
    from flame_core import grad_pool
    st = tiny.Stack(2, 16, 2, device, dtype=flame.float32, seed=3)
    st.gradient_checkpointing = True
    x, t = _batch(device, 8, 16, flame.float32)
    full = _full_batch_grads(st, x, t)
    params = st.parameters()
    grad_pool.register(params)
    try:
        for set_to_none in (True, False):       # first micro-batch copies into the views / everything adds
            grad_pool.zero_grad(params, set_to_none=set_to_none)
            for i in range(0, 8, 2):
                (_loss(st, x[i:i + 2], t[i:i + 2]) * 0.25).backward()
            for k, (p, f) in enumerate(zip(params, full)):
                flat = grad_pool.flat_buffer_of(p)
                off, _ = grad_pool.slice_of(p)
                assert p.grad.data_ptr() == flat.data_ptr() + off * flat.element_size()   # lives in the pool
                np.testing.assert_allclose(p.grad.numpy(), f, rtol=2e-4, atol=2e-6, err_msg=f"param {k}")
    finally:
        grad_pool.unregister(params)
