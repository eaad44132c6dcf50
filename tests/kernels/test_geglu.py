"""GEGLU of [a | gate] rows (cuda_src/geglu.cu) against its float64 formula and the reference path, on ragged
shapes (odd widths take the scalar path), in float32 / float16 / bfloat16, both GELU forms."""
import numpy as np
import pytest
from kernel_utils import DTYPES, assert_close, rand, to64

from flame_core.kernels import geglu as K

SHAPES = [(1, 8), (7, 13), (33, 640), (5, 2560), (300, 24), (2, 4096 * 3 + 5)]  # rows, C (x is rows x 2C)


def _gelu64(g, approximate):
    from math import erf, pi, sqrt
    if approximate == "tanh":
        return 0.5 * g * (1 + np.tanh(sqrt(2 / pi) * (g + 0.044715 * g ** 3)))
    return 0.5 * g * (1 + np.vectorize(erf)(g / sqrt(2)))


def _gelu64_grad(g, approximate):
    from math import erf, pi, sqrt
    if approximate == "tanh":
        t = np.tanh(sqrt(2 / pi) * (g + 0.044715 * g ** 3))
        return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * sqrt(2 / pi) * (1 + 3 * 0.044715 * g * g)
    return 0.5 * (1 + np.vectorize(erf)(g / sqrt(2))) + g * np.exp(-0.5 * g * g) / sqrt(2 * pi)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("rows,c", SHAPES)
@pytest.mark.parametrize("gate_first", [False, True])
def test_geglu_matches_float64(ab, rng, dt, rows, c, approximate, gate_first):
    x = rand(rng, (rows, 2 * c), DTYPES[dt], scale=2.5)
    dy = rand(rng, (rows, c), DTYPES[dt])
    a, g, d = to64(x)[:, :c], to64(x)[:, c:], to64(dy)
    if gate_first:
        a, g = g, a
    k, r = ab(lambda x: K.geglu_forward(x, approximate, gate_first), x)
    assert k.flags.c_contiguous and k.shape == (rows, c) and k.dtype == x.dtype
    assert_close(k, a * _gelu64(g, approximate), dt, "forward vs float64")
    assert_close(k, r, dt, "forward vs reference path")
    k, r = ab(lambda d, x: K.geglu_backward(d, x, approximate, gate_first=gate_first), dy, x)
    da, dg = d * _gelu64(g, approximate), d * a * _gelu64_grad(g, approximate)
    want = np.concatenate([dg, da] if gate_first else [da, dg], axis=1)
    assert k.shape == (rows, 2 * c)
    assert_close(k, want, dt, "backward vs float64")
    assert_close(k, r, dt, "backward vs reference path")
    import cupy as cp
    xi = cp.asarray(x)                                    # in place: the gradient written over x
    got = K.geglu_backward(cp.asarray(dy), xi, approximate, inplace=True, gate_first=gate_first)
    assert got is xi
    assert_close(got, k, dt, "in-place backward vs out of place")


def test_geglu_reference_on_the_cpu_and_shape_errors(rng):
    x = rand(rng, (4, 3, 10), np.float32)
    dy = rand(rng, (4, 3, 5), np.float32)
    a, g = x[..., :5].astype(np.float64), x[..., 5:].astype(np.float64)
    np.testing.assert_allclose(K.geglu_forward(x), a * _gelu64(g, "none"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(K.geglu_backward(dy, x, "tanh"),
                               np.concatenate([dy * _gelu64(g, "tanh"), dy * a * _gelu64_grad(g, "tanh")], -1),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(K.geglu_forward(x, "tanh", gate_first=True), g * _gelu64(a, "tanh"), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(K.geglu_backward(dy, x, "none", gate_first=True),
                               np.concatenate([dy * g * _gelu64_grad(a, "none"), dy * _gelu64(a, "none")], -1),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must be even"):
        K.geglu_forward(x[..., :9])
    with pytest.raises(ValueError, match="does not match"):
        K.geglu_backward(dy[..., :4], x)
