"""The engine sums gradients in place only into tensors it made itself and that are still waiting in its buffers.
A sum handed on by a backward (Add passes one gradient to both inputs), or one whose id Python reuses for another
tensor once it died, must never be written into: that silently corrupted gradients of small graphs with shared
subexpressions. Random programs are checked against central differences."""
import random

import numpy as np

import flame_core as flame


def _program(seed, xs):
    rnd = random.Random(seed)
    vals = list(xs)
    for _ in range(rnd.randint(3, 12)):
        a, b = rnd.choice(vals), rnd.choice(vals)
        op = rnd.choice(["add", "mul", "sub", "clone", "neg", "twice", "div"])
        vals.append({"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
                     "div": lambda: a / (b * b + 1), "clone": lambda: a.clone(), "neg": lambda: -a,
                     "twice": lambda: a + a}[op]())
    out = vals[-1].sum()
    for v in rnd.sample(vals, min(3, len(vals))):
        out = out + (v * 0.5).sum()
    return out


def _leaves(device, requires_grad):
    rng = np.random.default_rng(1)
    return [flame.tensor(rng.standard_normal(3), dtype=flame.float64, device=device, requires_grad=requires_grad)
            for _ in range(3)]


def test_shared_sum_is_not_accumulated_into(device):
    x0, x1, x2 = _leaves(device, True)
    v0 = x2 + x1
    v2 = v0 + v0
    v3 = x1 - x2
    out = v3.sum() + (v3 * 0.5).sum() + (x0 * 0.5).sum() + (v2 * 0.5).sum()
    out.backward()
    np.testing.assert_allclose(x0.grad.numpy(), [0.5] * 3)
    np.testing.assert_allclose(x1.grad.numpy(), [2.5] * 3)
    np.testing.assert_allclose(x2.grad.numpy(), [-0.5] * 3)


def test_random_programs_match_central_differences(device):
    eps = 1e-6
    for seed in range(200):
        xs = _leaves(device, True)
        _program(seed, xs).backward()
        got = [np.zeros(3) if x.grad is None else x.grad.numpy() for x in xs]
        base = _leaves(device, False)
        for i in range(3):
            for k in range(3):
                vals = []
                for s in (eps, -eps):
                    ys = [b.clone() for b in base]
                    ys[i]._data[k] += s
                    vals.append(_program(seed, ys).item())
                want = (vals[0] - vals[1]) / (2 * eps)
                assert abs(got[i][k] - want) < 1e-5 * max(1.0, abs(want)), (seed, i, k, got[i][k], want)
