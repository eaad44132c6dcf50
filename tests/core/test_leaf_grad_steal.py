"""A leaf's .grad keeps a Function's freshly computed gradient without copying it (PyTorch's AccumulateGrad steals a
gradient whose use count is 1), and copies every gradient something else still holds: one handed to two leaves,
one a Function kept, the caller's own grad_tensors, a view of a kept array. Keeping is checked by the memory address
of the leaf's .grad, copying by writing into the other holder afterwards."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import backend
from flame_core.autograd.function import Function
from flame_core.tensor import _wrap

KEPT = []


def _addr(a):
    return a.data.ptr if backend.is_cuda_array(a) else a.__array_interface__["data"][0]


class _Fresh(Function):
    """y = 2x; the backward's gradient is a new array (view=True: a reshaped view of one that nothing else holds)
    whose address is recorded (the array itself is not kept)."""
    seen = []

    @staticmethod
    def forward(ctx, x, view=False):
        ctx.view = view
        return _wrap(x._data * 2)

    @staticmethod
    def backward(ctx, gy):
        g = gy._data * 2
        if ctx.view:
            g = g.reshape(-1).reshape(gy.shape)
        _Fresh.seen.append(_addr(g))
        return _wrap(g), None


class _Keeps(Function):
    """As _Fresh, but the backward keeps its gradient array (or the base of a view of it) in KEPT."""
    @staticmethod
    def forward(ctx, x, view):
        ctx.view = view
        return _wrap(x._data * 2)

    @staticmethod
    def backward(ctx, gy):
        g = gy._data * 2
        KEPT.append(g)
        return _wrap(g.reshape(gy.shape) if ctx.view else g), None


def _leaf(device, shape=(3, 4)):
    return flame.randn(*shape, device=device, dtype=flame.float32).requires_grad_(True)


def test_fresh_gradient_is_kept_without_a_copy(device):
    x = _leaf(device)
    _Fresh.seen.clear()
    _Fresh.apply(x).backward(flame.ones(3, 4, device=device))
    assert _addr(x.grad._data) == _Fresh.seen[-1]
    np.testing.assert_allclose(x.grad.numpy(), 2.0)


def test_fresh_view_gradient_is_kept_without_a_copy(device):
    x = _leaf(device)
    _Fresh.seen.clear()
    _Fresh.apply(x, True).sum().backward()
    assert _addr(x.grad._data) == _Fresh.seen[-1]
    np.testing.assert_allclose(x.grad.numpy(), 2.0)


@pytest.mark.parametrize("view", [False, True])
def test_gradient_a_function_kept_is_copied(device, view):
    x = _leaf(device)
    KEPT.clear()
    _Keeps.apply(x, view).sum().backward()
    kept = KEPT.pop()
    assert _addr(x.grad._data) != _addr(kept)
    kept[...] = 7
    np.testing.assert_allclose(x.grad.numpy(), 2.0)


def test_one_gradient_for_two_leaves_is_copied(device):
    a, b = _leaf(device), _leaf(device)
    (a + b).backward(flame.ones(3, 4, device=device) * 3)   # Add hands one gradient to both
    assert _addr(a.grad._data) != _addr(b.grad._data)
    a.grad._data[...] = 0
    np.testing.assert_allclose(b.grad.numpy(), 3.0)


def test_callers_grad_tensor_is_copied(device):
    x = _leaf(device)
    go = flame.ones(3, 4, device=device)
    y = x.clone()
    y.backward(go)   # Clone passes the caller's gradient through
    go._data[...] = 5
    np.testing.assert_allclose(x.grad.numpy(), 1.0)


def test_kept_gradient_accumulates_across_backwards(device):
    x = _leaf(device)
    _Fresh.seen.clear()
    for _ in range(3):
        _Fresh.apply(x).sum().backward()
    assert _addr(x.grad._data) == _Fresh.seen[0]   # the first pass's array, summed into in place
    np.testing.assert_allclose(x.grad.numpy(), 6.0)


def test_conv_input_gradient_is_kept(device):
    """The case that cost a conv fwd+bwd a full copy of dx: conv2d's dx and dw go to leaf .grad as computed."""
    x = flame.randn(2, 3, 6, 6, device=device).requires_grad_(True)
    w = flame.randn(4, 3, 3, 3, device=device).requires_grad_(True)
    import flame_nn.functional as F
    from flame_core.ops.conv import function as C  # Conv2d.backward reads conv2d_backward there
    seen = []
    orig = C.conv2d_backward

    def spy(*a, **k):
        dx, dw = orig(*a, **k)
        seen.append((_addr(dx), _addr(dw)))
        return dx, dw
    C.conv2d_backward = spy
    try:
        F.conv2d(x, w, padding=1).sum().backward()
    finally:
        C.conv2d_backward = orig
    assert (_addr(x.grad._data), _addr(w.grad._data)) == seen[-1]
