"""F.conv2d_add: conv2d + add[:, :, None, None] + residual with the adds in the convolution (the wgmma epilogue on a
GPU): values and every gradient against the unfused ops in float64, a hypothesis gradcheck, bad shapes refused, the
dtype-mismatch fallback; on the GPU every path and plan (unsplit, split over K, tail split) in bf16 / fp16."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd.gradcheck import gradcheck


def _unfused(x, w, b, e, r, **kw):
    y = F.conv2d(x, w, b, **kw)
    if e is not None:
        y = y + e[:, :, None, None]
    if r is not None:
        y = y + r
    return y


@pytest.mark.parametrize("with_e, with_r, with_b", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=1), dict(padding="same", dilation=2)])
def test_matches_the_unfused_ops(device, with_e, with_r, with_b, kw):
    rng = np.random.default_rng(0)
    N, C, H, W, O = 2, 3, 9, 8, 5
    T = (lambda a: flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True))
    xs, ws, bs = rng.standard_normal((N, C, H, W)), rng.standard_normal((O, C, 3, 3)), rng.standard_normal(O)
    OH, OW = tuple(F.conv2d(flame.tensor(xs), flame.tensor(ws), **kw).shape[2:])
    es, rs = rng.standard_normal((N, O)), rng.standard_normal((N, O, OH, OW))
    gys = rng.standard_normal((N, O, OH, OW))
    outs = []
    for fn in (F.conv2d_add, _unfused):
        x, w = T(xs), T(ws)
        b, e, r = (T(bs) if with_b else None), (T(es) if with_e else None), (T(rs) if with_r else None)
        y = fn(x, w, b, e, r, **kw)
        y.backward(flame.tensor(gys, dtype=flame.float64, device=device))
        outs.append([y.detach().numpy()] + [t.grad.numpy() for t in (x, w, b, e, r) if t is not None])
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


@settings(max_examples=10, deadline=None)
@given(st.integers(4, 7), st.integers(4, 7), st.integers(1, 2))
def test_gradcheck_float64(H, W, stride):
    rng = np.random.default_rng(H * 10 + W)
    T = (lambda a: flame.tensor(a, dtype=flame.float64, requires_grad=True))
    x, w, b = T(rng.standard_normal((2, 2, H, W))), T(rng.standard_normal((3, 2, 3, 3))), T(rng.standard_normal(3))
    OH, OW = (H - 1) // stride + 1, (W - 1) // stride + 1
    e, r = T(rng.standard_normal((2, 3))), T(rng.standard_normal((2, 3, OH, OW)))
    assert gradcheck(lambda *a: F.conv2d_add(*a, stride=stride, padding=1), (x, w, b, e, r))


def test_other_dtype_adds_after_with_promotion():
    x, w = flame.randn(1, 2, 5, 5, dtype=flame.float32), flame.randn(3, 2, 3, 3, dtype=flame.float32)
    r = flame.randn(1, 3, 5, 5, dtype=flame.float64)
    y = F.conv2d_add(x, w, None, None, r, padding=1)
    assert y.dtype == flame.float64
    np.testing.assert_allclose(y.numpy(), (F.conv2d(x, w, padding=1) + r).numpy())


@pytest.mark.parametrize("e_shape, r_shape, match", [((1, 3), None, "add of shape"), ((2,), None, "add of shape"),
                                                    (None, (1, 3, 4, 4), "residual of shape")])
def test_bad_shapes_are_refused(e_shape, r_shape, match):
    x, w = flame.randn(1, 2, 5, 5), flame.randn(4, 2, 3, 3)
    e = None if e_shape is None else flame.randn(*e_shape)
    r = None if r_shape is None else flame.randn(*r_shape)
    with pytest.raises(Exception, match=match):
        F.conv2d_add(x, w, None, e, r, padding=1)


def test_unbatched_input_is_refused():
    with pytest.raises(Exception, match=r"\(N, C, H, W\)"):
        F.conv2d_add(flame.randn(2, 5, 5), flame.randn(4, 2, 3, 3), padding=1)


@pytest.mark.gpu
@pytest.mark.parametrize("algo, plan", [("wgmma", None), ("wgmma", "128x128:s3"), ("wgmma", "128x128:t2"),
                                        ("igemm", None), ("im2col", None)])   # plans are the wgmma kernel's
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_paths_match_float64(dtype, algo, plan, monkeypatch):
    """Every CUDA path with the adds (wgmma: in its epilogue, or its split reduction; the others after), bf16 / fp16
    against float64 on the cpu; a real-size-ish geometry so the tail split has a tail."""
    from flame_core.kernels import conv as K
    if algo == "wgmma" and not K.wgmma_available():
        pytest.skip("needs compute capability 9.0")
    monkeypatch.setenv("FLAME_CONV_ALGO", algo)
    if plan:
        monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", plan)
    dt = getattr(flame, dtype)
    rng = np.random.default_rng(2)
    N, C, H, W, O = 3, 24, 57, 55, 130
    r32 = (lambda a: flame.tensor(a.astype(np.float32)).to(dt).float().numpy().astype(np.float64))
    xs, ws = r32(rng.standard_normal((N, C, H, W))), r32(rng.standard_normal((O, C, 3, 3)) * 0.2)
    bs, es, rs = r32(rng.standard_normal(O)), r32(rng.standard_normal((N, O))), r32(rng.standard_normal((N, O, H, W)))
    gys = r32(rng.standard_normal((N, O, H, W)))
    G = (lambda a: flame.tensor(a, device="cuda").to(dt).requires_grad_(True))
    x, w, b, e, r = (G(a) for a in (xs, ws, bs, es, rs))
    y = F.conv2d_add(x, w, b, e, r, padding=1)
    y.backward(flame.tensor(gys, device="cuda").to(dt))
    R = (lambda a: flame.tensor(a, dtype=flame.float64, requires_grad=True))
    xr, wr, br, er, rr = (R(a) for a in (xs, ws, bs, es, rs))
    yr = _unfused(xr, wr, br, er, rr, padding=1)
    yr.backward(flame.tensor(gys, dtype=flame.float64))
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    for got, want in ((y.detach(), yr.detach()), (x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad),
                      (e.grad, er.grad), (r.grad, rr.grad)):
        a, bb = got.float().numpy().astype(np.float64), want.numpy()
        assert np.abs(a - bb).max() <= tol * np.abs(bb).max(), (np.abs(a - bb).max(), np.abs(bb).max())
