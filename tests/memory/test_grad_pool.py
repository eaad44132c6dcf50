"""Gradient buffer pool: .grad are views of flat per-(device, dtype) buffers; zero_grad is one memset; no new
gradient storage after registration."""
import gc

import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M
from flame_core import grad_pool


def npa(t):
    return t.detach().double().numpy()


def data_ptr(t):
    return t.data_ptr()


def make_params(device, rng):
    w1 = flame.tensor(rng.standard_normal((5, 7)), dtype=flame.float32, device=device, requires_grad=True)
    b1 = flame.tensor(rng.standard_normal(7), dtype=flame.float32, device=device, requires_grad=True)
    w2 = flame.tensor(rng.standard_normal((7, 3)), dtype=flame.float64, device=device, requires_grad=True)
    return w1, b1, w2


def loss_of(x, w1, b1, w2):
    return ((x @ w1 + b1).tanh().double() @ w2).square().sum()


def reference_grads(x, w1, b1, w2):
    """float64 NumPy gradients of loss_of (FLAME computes the first layer in float32: compare at ~1e-5)."""
    x, w1, b1, w2 = (np.asarray(npa(t)) for t in (x, w1, b1, w2))
    z = x @ w1 + b1
    h = np.tanh(z)
    y = h @ w2
    gy = 2 * y
    gw2 = h.T @ gy
    gz = (gy @ w2.T) * (1 - h * h)
    return x.T @ gz, gz.sum(0), gw2


def test_grads_are_views_of_one_flat_buffer_per_dtype(device, rng):
    w1, b1, w2 = make_params(device, rng)
    bufs = grad_pool.register([w1, b1, w2, w1])  # duplicates are ignored
    assert sorted(str(b.dtype) for b in bufs) == ["flame.float32", "flame.float64"]
    f32 = grad_pool.flat_buffer_of(w1)
    assert grad_pool.flat_buffer_of(b1) is f32 and grad_pool.flat_buffer_of(w2) is not f32
    assert f32.shape == (64 + 64,) and f32.dtype == flame.float32  # 35 and 7 elements, 256-byte aligned slots
    assert grad_pool.slice_of(w1) == (0, 35) and grad_pool.slice_of(b1) == (64, 7)
    assert w1.grad is None  # PyTorch: no gradient before the first backward
    x = flame.tensor(rng.standard_normal((4, 5)), dtype=flame.float32, device=device)
    loss_of(x, w1, b1, w2).backward()
    gw1, gb1, gw2 = reference_grads(x, w1, b1, w2)
    np.testing.assert_allclose(npa(w1.grad), gw1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(npa(b1.grad), gb1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(npa(w2.grad), gw2, rtol=1e-5)
    base = data_ptr(f32)
    assert data_ptr(w1.grad) == base and data_ptr(b1.grad) == base + 64 * 4
    assert data_ptr(w2.grad) == data_ptr(grad_pool.flat_buffer_of(w2))
    flat = npa(f32)
    np.testing.assert_allclose(flat[:35], gw1.ravel(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(flat[64:71], gb1, rtol=1e-4, atol=1e-5)
    assert not flat[35:64].any() and not flat[71:].any()  # alignment gaps stay zero


def test_accumulation_zero_grad_and_set_to_none(device, rng):
    w1, b1, w2 = make_params(device, rng)
    grad_pool.register([w1, b1, w2])
    x = flame.tensor(rng.standard_normal((4, 5)), dtype=flame.float32, device=device)
    g = reference_grads(x, w1, b1, w2)
    loss_of(x, w1, b1, w2).backward()
    loss_of(x, w1, b1, w2).backward()  # accumulates in place
    np.testing.assert_allclose(npa(w2.grad), 2 * g[2], rtol=1e-5)
    np.testing.assert_allclose(npa(w1.grad), 2 * g[0], rtol=1e-4, atol=1e-5)
    views = (w1.grad, b1.grad, w2.grad)
    grad_pool.zero_grad([w1, b1, w2])
    assert all(p.grad is v for p, v in zip((w1, b1, w2), views))
    assert not npa(grad_pool.flat_buffer_of(w1)).any() and not npa(w2.grad).any()
    loss_of(x, w1, b1, w2).backward()
    np.testing.assert_allclose(npa(b1.grad), g[1], rtol=1e-4, atol=1e-5)
    grad_pool.zero_grad([w1, b1, w2], set_to_none=True)
    assert w1.grad is None and b1.grad is None and w2.grad is None
    loss_of(x, w1, b1, w2).backward()  # copies into the (stale) view instead of adding
    np.testing.assert_allclose(npa(w1.grad), g[0], rtol=1e-4, atol=1e-5)
    assert data_ptr(w1.grad) == data_ptr(grad_pool.flat_buffer_of(w1))


def test_partial_zero_grad_clears_only_those_slices(device, rng):
    w1, b1, w2 = make_params(device, rng)
    grad_pool.register([w1, b1, w2])
    x = flame.tensor(rng.standard_normal((4, 5)), dtype=flame.float32, device=device)
    loss_of(x, w1, b1, w2).backward()
    before = npa(b1.grad)
    grad_pool.zero_grad([w1])
    assert not npa(w1.grad).any()
    np.testing.assert_array_equal(npa(b1.grad), before)


def test_zero_grad_of_everything_is_one_memset_per_buffer(device, rng, monkeypatch):
    w1, b1, w2 = make_params(device, rng)
    grad_pool.register([w1, b1, w2])
    x = flame.tensor(rng.standard_normal((4, 5)), dtype=flame.float32, device=device)
    loss_of(x, w1, b1, w2).backward()
    cleared = []
    real = grad_pool._memset
    monkeypatch.setattr(grad_pool, "_memset", lambda arr: (cleared.append(arr.size), real(arr)))
    gc.collect()  # other tests' buffers waiting in cycles
    grad_pool.zero_grad()
    resident = [b for b in grad_pool.buffers() if b.resident]  # (a lazy buffer without storage has nothing to zero)
    assert len(cleared) == len(resident)  # one memset per flat buffer, whole buffers
    assert sorted(cleared) == sorted(b.numel for b in resident)
    assert not npa(w1.grad).any() and not npa(w2.grad).any()


def test_no_new_gradient_storage_after_registration(device, rng, no_gc):
    w1, b1, w2 = make_params(device, rng)
    grad_pool.register([w1, b1, w2])
    x = flame.tensor(rng.standard_normal((4, 5)), dtype=flame.float32, device=device)
    ptrs = None
    for step in range(3):
        a0 = M.memory_allocated(device)
        n0 = M.memory_stats(device)["num_alloc"]
        loss_of(x, w1, b1, w2).backward()
        assert M.memory_allocated(device) == a0  # backward left nothing behind: grads live in the flat buffers
        assert M.memory_stats(device)["num_alloc"] > n0  # (it did allocate temporaries, and freed them)
        now = [data_ptr(p.grad) for p in (w1, b1, w2)]
        assert ptrs is None or now == ptrs
        ptrs = now
        grad_pool.zero_grad()


def test_existing_grad_is_kept_and_create_graph_takes_the_ordinary_path(device, rng):
    w = flame.tensor(rng.standard_normal(3), dtype=flame.float64, device=device, requires_grad=True)
    w.grad = flame.ones(3, dtype=flame.float64, device=device)
    grad_pool.register([w])
    assert data_ptr(w.grad) == data_ptr(grad_pool.flat_buffer_of(w))
    np.testing.assert_array_equal(npa(w.grad), [1, 1, 1])
    grad_pool.zero_grad([w], set_to_none=True)
    (g,) = flame.autograd.grad((w * w).sum(), [w], create_graph=True)
    np.testing.assert_allclose(npa(g), 2 * npa(w))
    (w * w).sum().backward(create_graph=True)  # a grad with a graph cannot live in a plain buffer
    assert w.grad.grad_fn is not None
    np.testing.assert_allclose(npa(w.grad), 2 * npa(w))
    # set_to_none cleared the buffer and the create_graph backward left it alone
    np.testing.assert_array_equal(npa(grad_pool.flat_buffer_of(w))[:4], [0, 0, 0, 0])


def test_unregistered_param_raises_and_dead_params_are_forgotten(device):
    p = flame.zeros(4, device=device, requires_grad=True)
    with pytest.raises(flame.AutogradError, match=r"shape \(4,\).*not registered"):
        grad_pool.flat_buffer_of(p)
    grad_pool.register([p])
    assert grad_pool.is_registered(p)
    n = len(grad_pool._slots)
    del p
    assert len(grad_pool._slots) == n - 1


def test_flat_buffer_is_released_with_its_last_parameter(device, no_gc):
    import weakref
    ps = [flame.zeros(300, device=device, requires_grad=True) for _ in range(3)]
    (buf,) = grad_pool.register(ps)
    ref = weakref.ref(buf)
    a0 = M.memory_allocated(device)
    sum(p.sum() for p in ps).backward()
    assert ps[0].grad is not None
    del buf, ps  # no cyclic GC (no_gc): plain reference counting must free the flat buffer
    assert ref() is None
    assert M.memory_allocated(device) < a0
