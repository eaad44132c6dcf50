"""Sub's backward subtracts its gradient from the one another consumer already sent to its second input
(Node.sub_from_pending_grad): one kernel where the engine would negate and then add, in place when the engine holds
that sum alone. The gradients are bit-identical to the negate-and-add path (a + (-b) == a - b), and the fusion stays
out of the way where it would change anything: a - a, broadcasting, a dtype the engine casts, create_graph."""
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    iadd, sub = engine._iadd, engine._sub

    def counted_iadd(a, b, op="add"):
        calls["isub"] += op == "sub"
        return iadd(a, b, op)

    def counted_sub(p, g):
        calls["sub"] += 1
        return sub(p, g)
    monkeypatch.setattr(engine, "_iadd", counted_iadd)
    monkeypatch.setattr(engine, "_sub", counted_sub)
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


def _random_program(rnd, xs):
    """Random small programs heavy in subtraction (a tensor subtracted in several places, a - a, chains)."""
    vals = list(xs)
    for _ in range(rnd.randint(3, 14)):
        a, b = rnd.choice(vals), rnd.choice(vals)
        op = rnd.choice(["sub", "sub", "rsub", "add", "mul", "scale", "tanh"])
        vals.append({"sub": lambda: a - b, "rsub": lambda: 0.5 - b, "add": lambda: a + b, "mul": lambda: a * b,
                     "scale": lambda: a * 1.5, "tanh": lambda: a.tanh()}[op]())
    out = vals[-1].sum()
    for v in rnd.sample(vals, min(3, len(vals))):
        out = out - (v * 0.25).sum()
    return out


@given(seed=st.integers(0, 10 ** 6), dtype=st.sampled_from(["float32", "bfloat16"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_programs_bit_identical_fused_and_not(device, seed, dtype):
    dt = getattr(flame, dtype)
    rng = np.random.default_rng(seed)
    data = [rng.standard_normal((2, 3)) for _ in range(3)]
    grads = []
    for fused in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not fused:
                unfused(mp)
            xs = [flame.tensor(a, dtype=dt, device=device, requires_grad=True) for a in data]
            _random_program(random.Random(seed), xs).backward()
            grads.append([np.zeros((2, 3), np.float32) if x.grad is None else x.grad.float().numpy() for x in xs])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
