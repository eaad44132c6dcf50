"""Fused modulate x*(1+scale)+shift and gated residual x+gate*y: reference, gradients, kernels vs reference."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, rand

import flame_core as flame
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import modulate as K
from flame_core.ops.modulation import gated_residual, modulate


def test_reference_matches_broadcast_formula(rng):
    x, sh, sc = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 1, 8)), rng.standard_normal((2, 1, 8))
    np.testing.assert_allclose(K.modulate_forward(x, sh, sc), x * (1 + sc) + sh, rtol=1e-15)
    np.testing.assert_allclose(K.modulate_forward(x, sh[:, 0], sc[:, 0]), x * (1 + sc) + sh, rtol=1e-15)
    y, gate = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 8))
    np.testing.assert_allclose(K.gated_residual_forward(x, gate, y), x + gate[:, None] * y, rtol=1e-15)


def test_backward_reduces_over_tokens(rng):
    x, g = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    sh, sc = rng.standard_normal((2, 1, 8)), rng.standard_normal((1, 8))  # scale shared over the batch
    dx, dsh, dsc = K.modulate_backward(g, x, sh, sc)
    np.testing.assert_allclose(dx, g * (1 + sc), rtol=1e-15)
    np.testing.assert_allclose(dsh, g.sum(1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(dsc, (g * x).sum((0, 1))[None], rtol=1e-13)
    assert dsh.shape == sh.shape and dsc.shape == sc.shape


def test_bad_modulation_shape_names_shapes():
    with pytest.raises(ShapeError, match=r"\(3, 1, 8\).*B=2, H=8"):
        K.modulate_forward(np.zeros((2, 4, 8)), np.zeros((3, 1, 8)), np.zeros((2, 1, 8)))


@given(b=st.integers(1, 2), l=st.integers(1, 3), h=st.integers(1, 4), mod_rank=st.sampled_from([2, 3]),
       shared=st.booleans())
def test_gradcheck(b, l, h, mod_rank, shared):
    rng = np.random.default_rng(b * 100 + l * 10 + h)
    mb = 1 if shared else b
    mshape = (mb, 1, h) if mod_rank == 3 else (mb, h)
    t = lambda s: flame.tensor(rng.standard_normal(s), dtype=flame.float64, requires_grad=True)  # noqa: E731
    x, y, sh, sc, gt = t((b, l, h)), t((b, l, h)), t(mshape), t(mshape), t(mshape)
    assert gradcheck(modulate, (x, sh, sc))
    assert gradcheck(gated_residual, (x, gt, y))


def test_fused_grads_match_composed_ops(device, rng):
    t = lambda s: flame.tensor(rng.standard_normal(s), dtype=flame.float32, device=device,  # noqa: E731
                               requires_grad=True)
    x, y, sh, sc, gt = t((2, 7, 16)), t((2, 7, 16)), t((2, 1, 16)), t((2, 1, 16)), t((2, 1, 16))
    gout = flame.tensor(rng.standard_normal((2, 7, 16)), dtype=flame.float32, device=device)
    leaves = (x, y, sh, sc, gt)
    (gated_residual(x, gt, modulate(y, sh, sc)) * gout).sum().backward()
    fused = [v.grad.numpy().copy() for v in leaves]
    for v in leaves:
        v.grad = None
    ((x + gt * (y * (1 + sc) + sh)) * gout).sum().backward()
    for got, v in zip(fused, leaves):
        np.testing.assert_allclose(got, v.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_double_backward():
    from flame_core.autograd import gradgradcheck
    rng = np.random.default_rng(5)
    t = lambda s: flame.tensor(rng.standard_normal(s), dtype=flame.float64, requires_grad=True)  # noqa: E731
    assert gradgradcheck(modulate, (t((2, 3, 4)), t((2, 1, 4)), t((2, 1, 4))))
    assert gradgradcheck(gated_residual, (t((2, 3, 4)), t((2, 4)), t((2, 3, 4))))


SHAPES = [(1, 1, 1), (1, 1, 8), (2, 5, 7), (3, 33, 64), (2, 257, 3072), (1, 4608, 3072), (1, 3, 12288), (4, 9, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mods", ["same", "fp32", "shared"])
def test_modulate_kernels(ab, rng, dt, shape, mods):
    d = DTYPES[dt]
    b, _, h = shape
    mshape = (1, 1, h) if mods == "shared" else (b, 1, h)
    md = np.float32 if mods == "fp32" else d
    x, y, g = rand(rng, shape, d), rand(rng, shape, d), rand(rng, shape, d)
    sh, sc, gt = rand(rng, mshape, md), rand(rng, mshape, md, scale=0.5), rand(rng, mshape, md)
    k, r = ab(K.modulate_forward, x, sh, sc)
    assert_close(k, r, dt, "modulate")
    (dxk, dshk, dsck), (dxr, dshr, dscr) = ab(K.modulate_backward, g, x, sh, sc)
    assert_close(dxk, dxr, dt, "dx")
    tol = "float32" if md == np.float32 else dt
    assert dshk.shape == mshape and dshk.dtype == md
    assert_close(dshk, dshr, tol, "dshift", scale=20)
    assert_close(dsck, dscr, tol, "dscale", scale=20)
    k, r = ab(K.gated_residual_forward, x, gt, y)
    assert_close(k, r, dt, "gated")
    (dxk, dgk, dyk), (dxr, dgr, dyr) = ab(K.gated_residual_backward, g, gt, y)
    assert_close(dxk, dxr, dt, "dx")
    assert_close(dyk, dyr, dt, "dy")
    assert_close(dgk, dgr, tol, "dgate", scale=20)
    for coef, off in ((sc, 1.0), (gt, 0.0)):  # the input gradients alone, for frozen modulation vectors
        k, r = ab(K.broadcast_scale, g, coef, off)
        assert k.dtype == g.dtype and k.shape == g.shape
        assert_close(k, r, dt, "broadcast_scale")


def test_broadcast_scale_reference(rng):
    g, c = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 1, 8))
    np.testing.assert_allclose(K.broadcast_scale(g, c, 1.0), g * (1 + c), rtol=1e-15)
    np.testing.assert_allclose(K.broadcast_scale(g, c[:1, 0], 0.0), g * c[:1], rtol=1e-15)


def test_frozen_modulation_vectors_take_the_input_gradient_alone(device, rng, monkeypatch):
    """A frozen base's adaLN: shift / scale / gate need no gradient, so backward keeps neither x nor y and computes
    dx = g (1 + scale), dy = g gate in one pass each (broadcast_scale), equal to the composed ops' gradients."""
    calls = []
    real = K.broadcast_scale
    monkeypatch.setattr(K, "broadcast_scale", lambda *a: calls.append(a[2]) or real(*a))
    t = lambda s, rg: flame.tensor(rng.standard_normal(s), dtype=flame.float32, device=device,  # noqa: E731
                                   requires_grad=rg)
    x, y = t((2, 7, 16), True), t((2, 7, 16), True)
    sh, sc, gt = t((2, 1, 16), False), t((2, 1, 16), False), t((2, 16), False)
    gout = flame.tensor(rng.standard_normal((2, 7, 16)), dtype=flame.float32, device=device)
    (gated_residual(x, gt, modulate(y, sh, sc)) * gout).sum().backward()
    assert sorted(calls) == [0.0, 1.0]
    fused = [x.grad.numpy().copy(), y.grad.numpy().copy()]
    x.grad = y.grad = None
    ((x + gt[:, None] * (y * (1 + sc) + sh)) * gout).sum().backward()
    np.testing.assert_allclose(fused[0], x.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fused[1], y.grad.numpy(), rtol=1e-5, atol=1e-6)
