"""Module.register_full_backward_hook / register_full_backward_pre_hook with PyTorch's semantics."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn


def npa(t):
    return t.detach().numpy().astype(np.float64)


def T(a, device, grad=False):
    return flame.tensor(np.asarray(a), dtype=flame.float64, device=device, requires_grad=grad)


class Mul(nn.Module):
    """forward(a, b, scale) = (a * b * scale, a + b): two tensor inputs, a number, two outputs."""

    def forward(self, a, b, scale):
        return a * b * scale, a + b


def test_grad_input_and_grad_output_values(device, rng):
    lin = nn.Linear(3, 2, device=device).to(flame.float64)
    seen = []
    lin.register_full_backward_hook(lambda m, gi, go: seen.append((m, gi, go)))
    x = T(rng.standard_normal((4, 3)), device, grad=True)
    w = T(rng.standard_normal((4, 2)), device)
    (lin(x) * w).sum().backward()
    (m, gi, go), = seen
    assert m is lin and isinstance(gi, tuple) and isinstance(go, tuple) and len(gi) == len(go) == 1
    np.testing.assert_allclose(npa(go[0]), npa(w))
    np.testing.assert_allclose(npa(gi[0]), npa(w) @ npa(lin.weight), rtol=1e-12)
    np.testing.assert_allclose(npa(x.grad), npa(gi[0]))


def test_hook_replaces_grad_input_and_removes(device, rng):
    lin = nn.Linear(3, 2, device=device).to(flame.float64)
    h = lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10,))
    x = T(rng.standard_normal((2, 3)), device, grad=True)
    lin(x).sum().backward()
    want = np.ones((2, 2)) @ npa(lin.weight)
    np.testing.assert_allclose(npa(x.grad), 10 * want, rtol=1e-12)
    assert lin.weight.grad is not None  # parameter gradients are not touched by the hook
    np.testing.assert_allclose(npa(lin.weight.grad), np.ones((2, 2)).T @ npa(x), rtol=1e-12)
    h.remove()
    x.grad = None
    lin(x).sum().backward()
    np.testing.assert_allclose(npa(x.grad), want, rtol=1e-12)
    lin.register_full_backward_hook(lambda m, gi, go: (gi[0], gi[0]))
    with pytest.raises(RuntimeError, match="invalid number of grad_input, got 2, but expected 1"):
        lin(x).sum().backward()


def test_several_inputs_outputs_and_none_entries(device, rng):
    m = Mul()
    seen = {}

    def hook(mod, gi, go):
        seen["gi"], seen["go"] = gi, go
        return (gi[0], None if gi[1] is None else gi[1] * 0)

    m.register_full_backward_hook(hook)
    a = T(rng.standard_normal(3), device, grad=True)
    b = T(rng.standard_normal(3), device)  # needs no gradient: its entry is None
    p, s = m(a, b, 2.0)
    (p.sum() + 3 * s.sum()).backward()
    assert len(seen["gi"]) == 2 and seen["gi"][1] is None and len(seen["go"]) == 2
    np.testing.assert_allclose(npa(seen["go"][0]), np.ones(3))
    np.testing.assert_allclose(npa(seen["go"][1]), 3 * np.ones(3))
    np.testing.assert_allclose(npa(a.grad), 2 * npa(b) + 3, rtol=1e-12)
    b2 = T(rng.standard_normal(3), device, grad=True)
    a.grad = None
    p, s = m(a, b2, 2.0)
    (p.sum() + s.sum()).backward()
    np.testing.assert_allclose(npa(b2.grad), 0.0)  # the hook zeroed it
    np.testing.assert_allclose(npa(a.grad), 2 * npa(b2) + 1, rtol=1e-12)


def test_hook_runs_when_no_input_needs_grad(device, rng):
    lin = nn.Linear(3, 2, device=device).to(flame.float64)
    calls = []
    lin.register_full_backward_hook(lambda m, gi, go: calls.append((gi, go)))
    lin(T(rng.standard_normal((2, 3)), device)).sum().backward()
    (gi, go), = calls
    assert gi == (None,) and tuple(go[0].shape) == (2, 2)
    with flame.no_grad():
        lin(T(rng.standard_normal((2, 3)), device))
    assert len(calls) == 1


def test_backward_pre_hook_replaces_grad_output(device, rng):
    lin = nn.Linear(3, 2, device=device).to(flame.float64)
    order = []
    lin.register_full_backward_pre_hook(lambda m, go: (order.append("pre"), (go[0] * 0.5,))[1])
    lin.register_full_backward_hook(lambda m, gi, go: order.append(("hook", float(go[0].sum().item()))))
    x = T(rng.standard_normal((2, 3)), device, grad=True)
    lin(x).sum().backward()
    assert order == ["pre", ("hook", 2.0)]  # the hook sees the replaced grad_output
    np.testing.assert_allclose(npa(x.grad), 0.5 * np.ones((2, 2)) @ npa(lin.weight), rtol=1e-12)
    np.testing.assert_allclose(npa(lin.bias.grad), [1.0, 1.0])  # the parameters got the replaced one too


def test_hooks_on_a_submodule_inside_a_model(device, rng):
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(device).to(flame.float64)
    got = {}
    net[1].register_full_backward_hook(lambda m, gi, go: got.update(gi=gi[0], go=go[0]))
    x = T(rng.standard_normal((5, 3)), device, grad=True)
    net(x).sum().backward()
    h = np.tanh(npa(x) @ npa(net[0].weight).T + npa(net[0].bias))
    go = np.ones((5, 1)) @ npa(net[2].weight)
    np.testing.assert_allclose(npa(got["go"]), go, rtol=1e-12)
    np.testing.assert_allclose(npa(got["gi"]), go * (1 - h * h), rtol=1e-12)
