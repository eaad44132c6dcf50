"""RoPE in the Flux layout: reference vs a per-element float64 loop, gradients, kernels vs reference."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, rand

import flame_core as flame
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import rope as K
from flame_core.ops.rope import apply_rope


def flux_freqs(pos, dim, theta=10000.0):
    """Flux's rope(): (..., L, dim/2, 2, 2) rotations [[cos, -sin], [sin, cos]] of pos * theta^(-2j/dim), float64."""
    omega = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = pos[..., None] * omega
    return np.stack([np.cos(ang), -np.sin(ang), np.sin(ang), np.cos(ang)], -1).reshape(*ang.shape, 2, 2)


def _loop64(x, f):
    b, h, l, d = x.shape
    out = np.empty_like(x)
    for i in np.ndindex(b, h, l):
        fb = f[i[0] if f.shape[0] > 1 else 0, 0, i[2]]
        for j in range(d // 2):
            x0, x1 = x[i][2 * j], x[i][2 * j + 1]
            out[i][2 * j] = fb[j, 0, 0] * x0 + fb[j, 0, 1] * x1
            out[i][2 * j + 1] = fb[j, 1, 0] * x0 + fb[j, 1, 1] * x1
    return out


def test_reference_rotates_adjacent_pairs(rng):
    x = rng.standard_normal((2, 3, 5, 8))
    f = flux_freqs(rng.uniform(0, 50, (2, 5)), 8)[:, None]        # (B, 1, L, D/2, 2, 2)
    np.testing.assert_allclose(K.rope_forward(x, f), _loop64(x, f), rtol=1e-13, atol=1e-14)
    # a rotation keeps the norm of every pair, and its transpose undoes it
    y = K.rope_forward(x, f)
    np.testing.assert_allclose((y.reshape(2, 3, 5, 4, 2) ** 2).sum(-1), (x.reshape(2, 3, 5, 4, 2) ** 2).sum(-1),
                               rtol=1e-12)
    np.testing.assert_allclose(K.rope_backward(y, f), x, rtol=1e-12, atol=1e-13)


def test_freqs_without_batch_axis_broadcast(rng):
    x = rng.standard_normal((2, 2, 4, 6))
    f = flux_freqs(np.arange(4.0), 6)                                 # (L, D/2, 2, 2)
    np.testing.assert_allclose(K.rope_forward(x, f), _loop64(x, f[None, None]), rtol=1e-13)


def test_shape_errors():
    with pytest.raises(ShapeError, match=r"\(1, 1, 5, 4, 2, 2\).*\(1, 2, 4, 8\)"):
        K.rope_forward(np.zeros((1, 2, 4, 8)), np.zeros((1, 1, 5, 4, 2, 2)))


@given(b=st.integers(1, 2), h=st.integers(1, 2), l=st.integers(1, 3), half=st.integers(1, 3),
       batched=st.booleans(), learn_freqs=st.booleans())
def test_gradcheck(b, h, l, half, batched, learn_freqs):
    rng = np.random.default_rng(b * 1000 + h * 100 + l * 10 + half)
    x = flame.tensor(rng.standard_normal((b, h, l, 2 * half)), dtype=flame.float64, requires_grad=True)
    f = flux_freqs(rng.uniform(0, 9, (b if batched else 1, l)), 2 * half)[:, None]
    f = flame.tensor(f, dtype=flame.float64, requires_grad=learn_freqs)
    assert gradcheck(apply_rope, (x, f))


def test_fused_grad_matches_composed_ops(device, rng):
    x = flame.tensor(rng.standard_normal((2, 3, 5, 8)), dtype=flame.float32, device=device, requires_grad=True)
    f = flame.tensor(flux_freqs(rng.uniform(0, 20, (1, 5)), 8)[:, None], dtype=flame.float32, device=device)
    g = flame.tensor(rng.standard_normal((2, 3, 5, 8)), dtype=flame.float32, device=device)
    (apply_rope(x, f) * g).sum().backward()
    fused = x.grad.numpy().copy()
    x.grad = None
    xr = x.reshape(2, 3, 5, 4, 1, 2)                                   # Flux's apply_rope, with Tensor ops
    out = (f[..., 0] * xr[..., 0] + f[..., 1] * xr[..., 1]).reshape(2, 3, 5, 8)
    (out * g).sum().backward()
    np.testing.assert_allclose(fused, x.grad.numpy(), rtol=1e-5, atol=1e-6)


SHAPES = [(1, 1, 1, 2), (1, 2, 3, 6), (2, 3, 17, 128), (1, 24, 4608, 128), (2, 5, 77, 64), (3, 1, 9, 10)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batched", [False, True])
def test_rope_kernel(ab, rng, dt, shape, batched):
    b, _, l, d = shape
    x = rand(rng, shape, DTYPES[dt])
    f = flux_freqs(rng.uniform(0, 4096, (b if batched else 1, l)), d)[:, None].astype(np.float32)
    k, r = ab(K.rope_forward, x, f)
    assert_close(k, r, dt, "rope")
    k, r = ab(K.rope_backward, x, f)
    assert_close(k, r, dt, "rope backward")
