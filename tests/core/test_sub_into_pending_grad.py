"""Sub's backward subtracts its gradient from the one another consumer already sent to its second input
(Node.sub_from_pending_grad): one kernel where the engine would negate and then add, in place when the engine holds
that sum alone. The gradients are bit-identical to the negate-and-add path (a + (-b) == a - b), and the fusion stays
out of the way where it would change anything: a - a, broadcasting, a dtype the engine casts, create_graph."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.autograd import engine
from flame_core.autograd.function import Node


def chain(x, n=12):
    """The overhead bench's chain: x is subtracted n times (its gradient waits while the others arrive)."""
    y = x
    for _ in range(n):
        y = (y * 1.01 + 0.5).tanh() - x
    return y.sum()


def unfused(monkeypatch):
    monkeypatch.setattr(Node, "sub_from_pending_grad", lambda self, i, g: False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_bit_identical_to_negate_and_add(device, rng, monkeypatch, dtype):
    dt = getattr(flame, dtype)
    x = flame.tensor(rng.standard_normal((5, 7)), dtype=dt, device=device, requires_grad=True)
    calls = {"isub": 0, "sub": 0}
    isub, sub = engine._isub, engine._sub

    def count(name, fn):
        def run(*a):
            calls[name] += 1
            return fn(*a)
        return run
    monkeypatch.setattr(engine, "_isub", count("isub", isub))
    monkeypatch.setattr(engine, "_sub", count("sub", sub))
    chain(x).backward()
    fused = x.grad.float().numpy().copy()
    # 12 subtractions of x: the first sends -g, the second makes a new sum, the other ten write into it
    assert calls == {"isub": 10, "sub": 1}
    x.grad = None
    unfused(monkeypatch)
    chain(x).backward()
    np.testing.assert_array_equal(fused, x.grad.float().numpy())


def test_against_the_analytic_gradient(device, rng):
    a = rng.standard_normal(9)
    x = flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)
    c = flame.tensor(rng.standard_normal(9), dtype=flame.float64, device=device)
    ((c - x) * 2.0 + (c - x) * 3.0 - x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(9, -6.0))


def test_the_same_tensor_on_both_sides(device, rng):
    x = flame.tensor(rng.standard_normal(6), dtype=flame.float32, device=device, requires_grad=True)
    y = x * 1.0
    (y - y + (y - y) * 2.0 - y).sum().backward()  # y's gradient waits while y - y runs
    np.testing.assert_array_equal(x.grad.numpy(), np.full(6, -1.0, np.float32))


def test_broadcast_and_cast_second_inputs(device, rng):
    x = flame.tensor(rng.standard_normal(4), dtype=flame.float32, device=device, requires_grad=True)
    m = flame.tensor(rng.standard_normal((3, 4)), dtype=flame.float32, device=device)
    ((m - x) - x * 2.0 + (m - x)).sum().backward()  # g is (3, 4), x (4,): summed over the rows, not fused
    np.testing.assert_allclose(x.grad.numpy(), np.full(4, -12.0), rtol=1e-6)
    h = flame.tensor(rng.standard_normal(4), dtype=flame.bfloat16, device=device, requires_grad=True)
    f = flame.tensor(rng.standard_normal(4), dtype=flame.float32, device=device)
    ((f - h) + (f - h) * 3.0).sum().backward()  # float32 gradients for a bfloat16 input: cast by the engine
    assert h.grad.dtype == flame.bfloat16
    np.testing.assert_array_equal(h.grad.float().numpy(), np.full(4, -4.0, np.float32))


def test_hooks_see_the_whole_sum_and_create_graph_differentiates_it(device, rng):
    x = flame.tensor(rng.standard_normal(5), dtype=flame.float64, device=device, requires_grad=True)
    h = x * 1.0
    seen = []
    h.register_hook(lambda g: seen.append(g.numpy().copy()))
    c = flame.tensor(rng.standard_normal(5), dtype=flame.float64, device=device)
    (c - h - h * 0.5 + (c - h) * 4.0).sum().backward()
    np.testing.assert_allclose(seen[0], np.full(5, -5.5))
    x.grad = None
    y = x * x
    (gx,) = flame.autograd.grad((c - y - y).sum(), x, create_graph=True)
    np.testing.assert_allclose(gx.detach().numpy(), -4 * x.detach().numpy())
    gx.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(5, -4.0))
