"""An element-wise backward may write its result into the gradient it was handed when nothing else holds that
gradient (Node.grad_is_exclusive; used by GELU(tanh), the MLP's widest gradient): the same numbers as a fresh buffer,
one buffer fewer, and never when the gradient is shared -- Add's two inputs, a hook or retain_grad that kept it, the
caller's grad_tensors, create_graph."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn.functional as F


def gelu_tanh_grad(a):
    u = np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)
    t = np.tanh(u)
    return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * a * a)


def leaf(rng, device, shape=(6, 40)):
    return flame.tensor(rng.standard_normal(shape), dtype=flame.float32, device=device, requires_grad=True)


def test_gelu_backward_writes_into_an_exclusive_gradient(device, rng):
    x = leaf(rng, device)
    c = rng.standard_normal((6, 40))
    h = x * 1.0  # a non-leaf input, as a Linear's output
    u = F.gelu(h, approximate="tanh")
    seen = {}
    u.register_hook(lambda g: seen.__setitem__("u", g.data_ptr()))
    h.register_hook(lambda g: seen.__setitem__("h", g.data_ptr()))
    (u * flame.tensor(c, dtype=flame.float32, device=device)).sum().backward()
    np.testing.assert_allclose(x.grad.double().numpy(), c * gelu_tanh_grad(x.detach().double().numpy()), rtol=2e-5,
                               atol=1e-6)
    assert seen["h"] == seen["u"]  # gelu's input gradient was written over its output's: no new buffer


def test_a_gradient_shared_with_another_input_is_not_overwritten(device, rng):
    x, w = leaf(rng, device), leaf(rng, device)
    c = rng.standard_normal((6, 40))
    u = F.gelu(x * 1.0, approximate="tanh")
    # Add hands one gradient to both inputs: gelu must not write into what w's branch still reads
    ((u + w * 3.0) * flame.tensor(c, dtype=flame.float32, device=device)).sum().backward()
    np.testing.assert_allclose(w.grad.double().numpy(), 3 * c, rtol=1e-6)
    np.testing.assert_allclose(x.grad.double().numpy(), c * gelu_tanh_grad(x.detach().double().numpy()), rtol=2e-5,
                               atol=1e-6)


def test_a_retained_or_hooked_gradient_keeps_its_values(device, rng):
    x = leaf(rng, device)
    c = rng.standard_normal((6, 40))
    u = F.gelu(x * 1.0, approximate="tanh")
    u.retain_grad()
    kept = []
    u.register_hook(lambda g: kept.append(g))
    (u * flame.tensor(c, dtype=flame.float32, device=device)).sum().backward()
    np.testing.assert_allclose(u.grad.double().numpy(), c, rtol=1e-6)
    np.testing.assert_allclose(kept[0].double().numpy(), c, rtol=1e-6)
    np.testing.assert_allclose(x.grad.double().numpy(), c * gelu_tanh_grad(x.detach().double().numpy()), rtol=2e-5,
                               atol=1e-6)


def test_the_callers_grad_tensors_are_left_alone(device, rng):
    x = leaf(rng, device)
    u = F.gelu(x * 1.0, approximate="tanh")
    g0 = rng.standard_normal((6, 40))
    g = flame.tensor(g0, dtype=flame.float32, device=device)
    u.backward(g)
    np.testing.assert_array_equal(g.double().numpy(), g0.astype(np.float32))
    np.testing.assert_allclose(x.grad.double().numpy(), g0 * gelu_tanh_grad(x.detach().double().numpy()), rtol=2e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [flame.float32, flame.bfloat16])
def test_in_place_and_fresh_backward_give_the_same_bits(device, rng, dtype):
    """The in-place result (exclusive gradient) against the same backward with the gradient kept alive elsewhere."""
    x0 = rng.standard_normal((4, 48))
    c = flame.tensor(rng.standard_normal((4, 48)), dtype=dtype, device=device)
    grads = []
    for keep in (False, True):
        x = flame.tensor(x0, dtype=dtype, device=device, requires_grad=True)
        u = F.gelu(x * 1.0, approximate="tanh")
        held = []
        if keep:
            u.register_hook(lambda g: held.append(g))
        (u * c).sum().backward()
        grads.append(x.grad.float().numpy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_create_graph_keeps_a_differentiable_gradient(device, rng):
    x = leaf(rng, device, (3, 5))
    u = F.gelu(x * 1.0, approximate="tanh")
    (g,) = flame.autograd.grad(u.sum(), x, create_graph=True)
    g.sum().backward()  # second order through gelu': runs only if the first-order gradient stayed in the graph
    assert x.grad is not None and np.isfinite(x.grad.numpy()).all()


def test_an_mlp_writes_gelus_gradient_over_the_linears(device, rng):
    """Linear -> GELU(tanh) -> Linear: fc2's input gradient is its GEMM's result reshaped (a view of a tensor only
    it holds); GELU writes into it, and the numbers equal the backward with that gradient held elsewhere."""
    import flame_nn as nn
    flame.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 64).to(device), nn.Linear(64, 16).to(device)
    x0 = rng.standard_normal((2, 8, 16))
    out = []
    for keep in (False, True):
        x = flame.tensor(x0, dtype=flame.float32, device=device, requires_grad=True)
        h = fc1(x)
        u = F.gelu(h, approximate="tanh")
        seen, held = {}, []
        u.register_hook(lambda g: held.append(g) if keep else seen.__setitem__("u", g.data_ptr()))
        h.register_hook(lambda g: seen.__setitem__("h", g.data_ptr()))
        fc2(u).square().sum().backward()
        if not keep:
            assert seen["h"] == seen["u"]
        else:
            assert seen["h"] != held[0].data_ptr()
        out.append((x.grad.numpy().copy(), fc1.weight.grad.numpy().copy()))
        fc1.zero_grad(), fc2.zero_grad()
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_scalar_mul_and_tanh_backward_write_into_an_exclusive_gradient(device, rng):
    # small cuda arrays: x * s's and tanh's backward rules write into the gradient they were handed alone
    x = leaf(rng, device, (3, 5))
    c = rng.standard_normal((3, 5))
    h = x * 1.0
    u = h.tanh()
    v = 2.5 * (u * 3.0)
    seen = {}
    for name, t in (("h", h), ("u", u), ("v", v)):
        t.register_hook(lambda g, name=name: seen.__setitem__(name, g.data_ptr()))
    (v * flame.tensor(c, dtype=flame.float32, device=device)).sum().backward()
    t = np.tanh(x.detach().double().numpy())
    np.testing.assert_allclose(x.grad.double().numpy(), c * 7.5 * (1 - t * t), rtol=2e-5, atol=1e-6)
    if device.type == "cuda":
        assert seen["h"] == seen["u"] == seen["v"]


def test_a_gradient_two_scalar_products_share_is_not_overwritten(device, rng):
    x = leaf(rng, device, (4, 3))
    a = x * 1.0
    kept = []
    a.register_hook(lambda g: kept.append(g))
    ((a * 2.0 + a * 3.0) + (a.tanh() + a.tanh() * 0.5)).sum().backward()  # Add hands one gradient to both sides
    t = np.tanh(x.detach().double().numpy())
    np.testing.assert_allclose(x.grad.double().numpy(), 5 + 1.5 * (1 - t * t), rtol=2e-5)
    np.testing.assert_allclose(kept[0].double().numpy(), 5 + 1.5 * (1 - t * t), rtol=2e-5)
