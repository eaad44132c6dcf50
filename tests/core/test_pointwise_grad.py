"""The fused first-order backward kernels of unary ops (cuda_src/pointwise_grad.cu) against the composed rules."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.kernels import loader

OPS = {"tanh": lambda x: x.tanh(), "sigmoid": lambda x: x.sigmoid(), "relu": lambda x: x.relu(),
       "sqrt": lambda x: x.sqrt(), "rsqrt": lambda x: x.rsqrt(), "abs": lambda x: x.abs()}
TOL = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}


def _grad(op, a, g, dtype, device):
    x = flame.tensor(a, device=device).to(dtype).requires_grad_()
    OPS[op](x).backward(flame.tensor(g, device=device).to(dtype))
    return x.grad.float().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_fused_unary_backward_matches_composed(op, dtype):
    rng = np.random.default_rng(0)
    for shape in [(1,), (37, 29), (3, 1025), (16384,)]:
        a = rng.uniform(0.1, 2.0, size=shape) if op in ("sqrt", "rsqrt") else rng.standard_normal(shape)
        g = rng.standard_normal(shape)
        fused = _grad(op, a, g, getattr(flame, dtype), "cuda")
        with loader.reference():
            composed = _grad(op, a, g, getattr(flame, dtype), "cuda")
        np.testing.assert_allclose(fused, composed, rtol=TOL[dtype], atol=TOL[dtype])


def test_composed_rules_on_this_device(device):
    """The same gradients on whatever device runs the suite, checked against float64 NumPy formulas."""
    rng = np.random.default_rng(1)
    a = rng.uniform(0.1, 2.0, size=(5, 7))
    g = rng.standard_normal((5, 7))
    want = {"tanh": g * (1 - np.tanh(a) ** 2), "sigmoid": g * (s := 1 / (1 + np.exp(-a))) * (1 - s),
            "relu": g * (a > 0), "sqrt": g * 0.5 / np.sqrt(a), "rsqrt": -0.5 * g * a ** -1.5, "abs": g * np.sign(a)}
    for op, w in want.items():
        np.testing.assert_allclose(_grad(op, a, g, flame.float32, device), w, rtol=1e-5, atol=1e-6, err_msg=op)
