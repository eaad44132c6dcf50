"""The host fast paths of the tape give the same results as the general paths they skip.

Function.apply gives an op that records nothing (grad mode off, or no input requiring grad) a light ctx; first-order
backward rules of mul, sub and the plain-arithmetic unary ops run on the arrays instead of through Tensor ops. Each
must agree bit for bit with the composed rule (the same ufuncs in the same order) and leave double backward alone.
"""
import numpy as np
import pytest

import flame_core as flame
from flame_core.device import default_device
from flame_core.ops import elementwise as E

UNARY = ["neg", "exp", "log", "log1p", "sqrt", "rsqrt", "tanh", "sigmoid", "reciprocal", "square"]


def _same(actual, desired, dtype):
    """Bit for bit on cpu (the same NumPy ufuncs in the same order); on cuda within rounding (fused kernels and GPU
    reductions order their arithmetic differently from the composed rule)."""
    if default_device().type == "cpu":
        np.testing.assert_array_equal(actual, desired)
    else:
        np.testing.assert_allclose(actual, desired, rtol=1e-6 if dtype == flame.float32 else 1e-14, atol=1e-7)


def _x(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return flame.tensor(rng.uniform(0.2, 1.5, size=(3, 5)).astype(np.float64), dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", [flame.float32, flame.float64])
def test_unary_fast_backward_matches_composed_rule(name, dtype):
    x = _x(dtype)
    g = flame.tensor(np.random.default_rng(1).standard_normal((3, 5)), dtype=dtype)
    y = getattr(x, name)()
    (gx,) = flame.autograd.grad(y, x, g, retain_graph=True)  # first order: the array path
    node = y.grad_fn
    with flame.enable_grad():  # grad mode on: the composed Tensor-op rule
        ref = node._fn.backward(node, g)
    assert gx.dtype == dtype
    _same(gx.numpy(), ref.detach().numpy(), dtype)


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "exp", "square"])
def test_unary_double_backward_still_composed(name):
    x = _x(flame.float64)
    y = getattr(x, name)().sum()
    (gx,) = flame.autograd.grad(y, x, create_graph=True)
    assert gx.grad_fn is not None
    (ggx,) = flame.autograd.grad(gx.sum(), x)
    eps = 1e-6
    xp = x.detach().numpy()
    f = {"tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "exp": np.exp, "square": np.square}[name]
    d1 = lambda v: (f(v + eps) - f(v - eps)) / (2 * eps)  # noqa: E731
    num = (d1(xp + eps) - d1(xp - eps)) / (2 * eps)
    np.testing.assert_allclose(ggx.numpy(), num, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", [flame.float16, flame.bfloat16])
def test_half_types_take_the_composed_rule(dtype):
    x = _x(dtype)
    y = x.tanh() * 1.5 - x
    y.sum().backward()
    xf = x.detach().to(flame.float32)
    # composed rule in the tensor's dtype: g * (1 - y*y), rounded as the Tensor ops round
    t = xf.tanh().to(dtype)
    ref = (flame.ones_like(t) * 1.5) * (1 - t * t) - 1
    np.testing.assert_allclose(x.grad.to(flame.float32).numpy(), ref.to(flame.float32).numpy(), rtol=2e-2,
                               atol=2e-2)
    assert x.grad.dtype == dtype


@pytest.mark.parametrize("dtype", [flame.float32, flame.float64])
def test_mul_sub_fast_backward(dtype):
    a = _x(dtype, 2)
    b = _x(dtype, 3)
    c = flame.tensor(np.random.default_rng(4).standard_normal((5,)), dtype=dtype, requires_grad=True)  # broadcast
    out = (a * b) * 1.25 - c * a - 3 * b
    g = flame.tensor(np.random.default_rng(5).standard_normal((3, 5)), dtype=dtype)
    out.backward(g)
    an, bn, cn, gn = (t.detach().numpy() for t in (a, b, c, g))
    _same(a.grad.numpy(), (gn * 1.25) * bn + (-gn) * cn, dtype)
    _same(b.grad.numpy(), (gn * 1.25) * an + (-gn) * 3, dtype)
    _same(c.grad.numpy(), ((-gn) * an).sum(0), dtype)
    assert E._grad_mul(g, 2.0)._data.dtype == g._data.dtype


def test_mul_backward_mixed_dtypes_promote_as_tensor_ops():
    a = flame.tensor([1.0, 2.0], dtype=flame.float32, requires_grad=True)
    b = flame.tensor([3.0, 4.0], dtype=flame.float64, requires_grad=True)
    (a * b).sum().backward()
    assert a.grad.dtype == flame.float32 and b.grad.dtype == flame.float64
    np.testing.assert_array_equal(a.grad.numpy(), [3.0, 4.0])
    np.testing.assert_array_equal(b.grad.numpy(), [1.0, 2.0])


def test_zero_dim_fast_backward():
    x = flame.tensor(0.5, requires_grad=True)
    y = (x.tanh() * 2.0 - x).exp()
    y.backward()
    v = 0.5
    ref = np.exp(np.tanh(v) * 2 - v) * ((1 - np.tanh(v) ** 2) * 2 - 1)
    assert x.grad.shape == () and abs(x.grad.item() - ref) < 1e-6


class _Scale(flame.Function):
    seen = []

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        _Scale.seen.append((ctx.needs_input_grad, ctx.saved_tensors[0] is x))
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k, None


def test_unrecorded_ctx_keeps_the_ctx_api():
    _Scale.seen.clear()
    x = flame.ones(3, requires_grad=True)
    with flame.no_grad():
        y = _Scale.apply(x, 2.0)
    assert y.grad_fn is None and not y.requires_grad
    z = _Scale.apply(flame.ones(3), 2.0)  # grad mode on, nothing requires grad
    assert z.grad_fn is None
    w = _Scale.apply(x, 3.0)  # recorded
    w.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0, 3.0])
    assert _Scale.seen == [((False, False), True), ((False, False), True), ((True, False), True)]
    assert flame.is_grad_enabled()


def test_grad_mode_restored_after_forward_error():
    x = flame.ones(3, requires_grad=True)
    with pytest.raises(flame.ShapeError):
        x * flame.ones(4)
    assert flame.is_grad_enabled()
    with flame.no_grad():
        with pytest.raises(flame.ShapeError):
            x * flame.ones(4)
        assert not flame.is_grad_enabled()
    assert flame.is_grad_enabled()


def test_saved_tensor_modified_in_place_still_raises():
    x = flame.ones(3, requires_grad=True)
    y = x * 2.0
    t = y.tanh()
    y.add_(1.0)  # y is not saved by tanh (it saves its output) ...
    z = y * y  # ... but mul saves y
    y.mul_(2.0)
    with pytest.raises(flame.AutogradError, match="modified by an in-place"):
        z.sum().backward()
    t.sum().backward()
