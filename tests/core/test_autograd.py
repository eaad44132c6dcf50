"""Autograd semantics: the engine, Function API, hooks, grad modes, version counters, freed graphs."""
import gc
import weakref

import numpy as np
import pytest

import flame_core as flame
from flame_core.autograd import Function


def npa(t):
    return t.detach().numpy().astype(np.float64)


def test_leaf_accumulates_across_backwards(device):
    x = flame.tensor([1.0, 2.0], device=device, requires_grad=True)
    (x * x).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(npa(x.grad), [2 + 3, 4 + 3])


def test_shared_subexpression_and_broadcast_reduction(device):
    x = flame.tensor([[1.0, 2.0, 3.0]], device=device, requires_grad=True)  # (1, 3)
    b = flame.tensor([[1.0], [2.0]], device=device, requires_grad=True)  # (2, 1)
    y = x * b + x  # (2, 3)
    y.sum().backward()
    np.testing.assert_allclose(npa(x.grad), [[1 + 2 + 2] * 3])
    np.testing.assert_allclose(npa(b.grad), [[6.0], [6.0]])


def test_backward_with_gradient_argument_and_scalar_requirement(device):
    x = flame.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    y = x * 2
    with pytest.raises(flame.AutogradError, match="scalar"):
        y.backward()
    y.backward(flame.tensor([1.0, 0.5, 0.0], device=device))
    np.testing.assert_allclose(npa(x.grad), [2.0, 1.0, 0.0])
    with pytest.raises(flame.ShapeError):
        (x * 2).backward(flame.ones(2, device=device))


def test_second_backward_through_freed_graph_raises(device):
    x = flame.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(flame.AutogradError, match="second time"):
        y.backward()
    z = (x.exp() * x).sum()
    z.backward(retain_graph=True)
    z.backward()  # retained: works
    np.testing.assert_allclose(npa(x.grad), 2 * npa(x) + 2 * np.exp(npa(x)) * (1 + npa(x)), rtol=1e-6)


def test_inplace_modification_of_saved_tensor_raises(device):
    x = flame.tensor([1.0, 2.0], device=device, requires_grad=True)
    a = x * 1
    y = a * a  # saves a
    a.add_(1)
    with pytest.raises(flame.AutogradError, match="modified by an in-place operation"):
        y.sum().backward()
    b = x.exp()  # saves its output
    b.mul_(2)
    with pytest.raises(flame.AutogradError, match="version"):
        b.sum().backward()


def test_non_recursive_10000_op_chain(device):
    x = flame.tensor([1.0], device=device, requires_grad=True)
    y = x
    for _ in range(10000):
        y = y * 1.0001
    y.sum().backward()
    np.testing.assert_allclose(npa(x.grad), [1.0001 ** 10000], rtol=1e-3)


def test_grad_modes(device):
    x = flame.ones(2, device=device, requires_grad=True)
    with flame.no_grad():
        y = x * 2
        with flame.enable_grad():
            z = x * 2
    assert not y.requires_grad and z.requires_grad
    with flame.set_grad_enabled(False):
        assert not (x * 2).requires_grad
    assert flame.is_grad_enabled()
    with flame.inference_mode():
        assert not (x * 2).requires_grad

    @flame.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad and flame.is_grad_enabled()


def test_autograd_grad_does_not_touch_dot_grad_and_allow_unused(device):
    x = flame.tensor([1.0, 2.0], device=device, requires_grad=True)
    w = flame.tensor([3.0, 4.0], device=device, requires_grad=True)
    u = flame.tensor([5.0], device=device, requires_grad=True)
    y = (x * w).sum()
    gx, gw = flame.autograd.grad(y, (x, w), retain_graph=True)
    np.testing.assert_allclose(npa(gx), [3, 4])
    np.testing.assert_allclose(npa(gw), [1, 2])
    assert x.grad is None and w.grad is None
    with pytest.raises(flame.AutogradError, match="not have been used"):
        flame.autograd.grad(y, (x, u), retain_graph=True)
    gx, gu = flame.autograd.grad(y, (x, u), allow_unused=True)
    assert gu is None


def test_double_backward_create_graph(device):
    x = flame.tensor([0.5, -1.0, 2.0], dtype=flame.float64, device=device, requires_grad=True)
    y = (x ** 3).sum()
    (g,) = flame.autograd.grad(y, x, create_graph=True)
    np.testing.assert_allclose(npa(g), 3 * npa(x) ** 2)
    g.sum().backward()
    np.testing.assert_allclose(npa(x.grad), 6 * npa(x))


def test_hooks_and_retain_grad(device):
    x = flame.tensor([1.0, 2.0], device=device, requires_grad=True)
    seen = []
    h = x.register_hook(lambda g: seen.append(npa(g)) or g * 10)
    y = x * 2
    y.retain_grad()
    y.register_hook(lambda g: g + 1)
    y.sum().backward()
    np.testing.assert_allclose(seen[0], [4.0, 4.0])  # (1 + 1) * 2 reaching the leaf
    np.testing.assert_allclose(npa(x.grad), [40.0, 40.0])
    np.testing.assert_allclose(npa(y.grad), [2.0, 2.0])
    h.remove()
    x.grad = None
    (x * 2).sum().backward()
    np.testing.assert_allclose(npa(x.grad), [2.0, 2.0])


def test_custom_function_ctx_api(device):
    calls = {}

    class MulAdd(Function):
        @staticmethod
        def forward(ctx, a, b, c):
            calls["needs"] = ctx.needs_input_grad
            ctx.save_for_backward(a, b)
            idx = flame.zeros(1, dtype=flame.int64, device=a.device)
            ctx.mark_non_differentiable(idx)
            return a * b + c, idx

        @staticmethod
        def backward(ctx, g, g_idx):
            a, b = ctx.saved_tensors
            return g * b, g * a, None

    a = flame.tensor([2.0], device=device, requires_grad=True)
    b = flame.tensor([3.0], device=device)
    out, idx = MulAdd.apply(a, b, 1.0)
    assert calls["needs"] is not None
    assert out.requires_grad and not idx.requires_grad and out.grad_fn.name() == "MulAddBackward"
    out.sum().backward()
    np.testing.assert_allclose(npa(a.grad), [3.0])


def test_ctx_needs_input_grad_is_per_argument(device):
    record = []

    class F(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, g):
            record.append(ctx.needs_input_grad)
            return (g if ctx.needs_input_grad[0] else None), (g if ctx.needs_input_grad[1] else None)

    a = flame.ones(2, device=device, requires_grad=True)
    b = flame.ones(2, device=device)
    F.apply(a, b).sum().backward()
    assert record[-1] == (True, False)


def test_saved_tensors_and_intermediates_are_freed(device):
    x = flame.randn(64, device=device, requires_grad=True)
    h = x.exp()
    ref = weakref.ref(h)
    y = (h * x).sum()
    del h
    gc.collect()
    assert ref() is not None  # kept alive by the graph (mul saves h for x's gradient)
    y.backward()
    gc.collect()
    assert ref() is None  # released once backward consumed it


def test_mul_by_a_scalar_keeps_nothing_of_its_tensor(device):
    # x * 2.0's backward needs only the scalar (torch's MulBackward1): the graph does not keep the tensor alive,
    # and the gradient stays right
    x = flame.randn(64, device=device, requires_grad=True)
    h = x * 3.0
    ref = weakref.ref(h)
    y = (h * 2.0).sum() + (0.5 * h).sum()
    del h
    gc.collect()
    assert ref() is None
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(64, 7.5, np.float32), rtol=1e-6)


def test_no_reference_cycle_from_saved_outputs(device):
    x = flame.randn(8, device=device, requires_grad=True)
    y = x.exp()  # exp saves its output
    ref = weakref.ref(y)
    gc.disable()
    try:
        del y
        assert ref() is None  # freed by refcount alone: no output -> node -> output cycle
    finally:
        gc.enable()


def test_requires_grad_rules(device):
    with pytest.raises(flame.AutogradError, match="floating point"):
        flame.ones(2, dtype=flame.int64, device=device).requires_grad_()
    x = flame.ones(2, device=device, requires_grad=True)
    y = x * 2
    with pytest.raises(flame.AutogradError, match="leaf"):
        y.requires_grad_(False)
    d = y.detach()
    assert not d.requires_grad and d._data is y._data
    assert (x > 0).requires_grad is False


def test_multi_output_node_missing_grads_are_zero(device):
    x = flame.arange(6, dtype=flame.float32, device=device).requires_grad_()
    a, b, c = x.split(2)
    (b * 3).sum().backward()  # only one of the three outputs is used
    np.testing.assert_allclose(npa(x.grad), [0, 0, 3, 3, 0, 0])


def test_leaf_grads_never_alias(device):
    a = flame.ones(3, device=device, requires_grad=True)
    b = flame.ones(3, device=device, requires_grad=True)
    (a + b).sum().backward()  # Add hands the same gradient to both inputs
    (a * 2).sum().backward()
    np.testing.assert_allclose(npa(a.grad), [3.0] * 3)
    np.testing.assert_allclose(npa(b.grad), [1.0] * 3)
    c = flame.ones(2, 3, device=device, requires_grad=True)
    c.sum().backward()  # the gradient is a broadcast view of one scalar
    c.sum().backward()
    np.testing.assert_allclose(npa(c.grad), np.full((2, 3), 2.0))


def test_gradient_takes_the_dtype_of_the_tensor_it_flows_into(device):
    # a bf16 activation joined to an fp32 residual: its gradient must come back bf16 (as in PyTorch), else every
    # matmul behind it would run in fp32
    w = flame.randn(8, 8, device=device, dtype=flame.bfloat16, requires_grad=True)
    x = flame.randn(4, 8, device=device, dtype=flame.bfloat16)
    seen = []
    h = x @ w
    h.register_hook(lambda g: seen.append(g.dtype))
    res = flame.randn(4, 8, device=device)                  # fp32
    (res + h).sum().backward()                              # Add's rule returns an fp32 gradient for h
    assert seen == [flame.bfloat16]
    assert w.grad.dtype == flame.bfloat16
