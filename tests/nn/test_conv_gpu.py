"""conv2d's raw CUDA kernels (cuda_src/im2col.cu) against the xp reference, and the GPU conv against float64."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.dtypes import dtype as parse_dtype
import flame_nn.functional as F
from flame_core import backend
from flame_core.ops import conv as C

import nn_reference as ref

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16", "float64"]
GEOMS = [  # (N, C, H, W, O, KH, KW, stride, padding, dilation, groups)
    (2, 3, 9, 7, 4, 3, 3, 1, 1, 1, 1),
    (1, 5, 11, 6, 5, 3, 2, (2, 1), (1, 0), (1, 2), 5),
    (3, 2, 8, 8, 4, 1, 1, 2, 0, 1, 1),
    (2, 4, 13, 10, 6, 5, 3, 3, 2, 1, 2),
]


def _geom(cfg):
    N, Cc, H, W, O, KH, KW, s, p, d, g = cfg
    return C.geometry((N, Cc, H, W), (O, Cc // g, KH, KW), s, p, d, g)


def _chunks(g):
    """Whole batch, one image, and bands of 1 and 3 output rows."""
    yield 0, g.N, 0, g.OH
    yield g.N - 1, 1, 0, g.OH
    yield 0, 1, g.OH // 2, 1
    yield g.N - 1, 1, 0, min(3, g.OH)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", GEOMS)
def test_im2col_kernel_matches_reference(dtype, cfg):
    cp = backend.cupy
    g = _geom(cfg)
    x = cp.asarray(np.random.default_rng(0).standard_normal((g.N, g.C, g.H, g.W))).astype(parse_dtype(dtype).np)
    for chunk in _chunks(g):
        got = C._im2col_cuda(x, g, *chunk)
        want = C.im2col_reference(x, g, *chunk)
        assert got.shape == want.shape
        np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint8), cp.asnumpy(want).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", GEOMS)
def test_col2im_kernel_matches_reference(dtype, cfg):
    cp = backend.cupy
    g = _geom(cfg)
    rng = np.random.default_rng(1)
    npdt = parse_dtype(dtype).np
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=1e-5, atol=1e-5) \
        if dtype == "float32" else dict(rtol=1e-2, atol=2e-2)
    for n0, nimg, oh0, nrows in _chunks(g):
        dcols = cp.asarray(rng.standard_normal((g.C * g.KH * g.KW, nimg * nrows * g.OW))).astype(npdt)
        base = cp.asarray(rng.standard_normal((g.N, g.C, g.H, g.W))).astype(npdt)
        for accumulate in (False, True):
            got, want = base.copy(), base.copy()
            C._col2im_cuda(dcols, got, g, n0, nimg, oh0, nrows, accumulate)
            C.col2im_reference(dcols, want, g, n0, nimg, oh0, nrows, accumulate)
            np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), cp.asnumpy(want).astype(np.float64),
                                       **tol)


@pytest.mark.parametrize("dtype, rtol", [("float32", 2e-3), ("bfloat16", 3e-2), ("float16", 5e-3)])
def test_gpu_conv2d_forward_backward_vs_float64(dtype, rtol, monkeypatch):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 16, 12, 10))
    w = rng.standard_normal((8, 16, 3, 3)) * 0.1
    b = rng.standard_normal(8)
    gy = rng.standard_normal((2, 8, 12, 10))
    want = ref.conv2d(x, w, b, padding=(1, 1))
    # float64 cpu gradients as the reference for dx, dw
    xr, wr = flame.tensor(x, device="cpu", requires_grad=True), flame.tensor(w, device="cpu", requires_grad=True)
    F.conv2d(xr, wr, padding=1).backward(flame.tensor(gy, device="cpu"))
    for mb in (None, "0.01"):  # default chunks, and row bands
        if mb:
            monkeypatch.setenv("FLAME_CONV_WORKSPACE_MB", mb)
        dt = parse_dtype(dtype)
        xt = flame.tensor(x, dtype=dt, device="cuda", requires_grad=True)
        wt = flame.tensor(w, dtype=dt, device="cuda", requires_grad=True)
        bt = flame.tensor(b, dtype=dt, device="cuda", requires_grad=True)
        y = F.conv2d(xt, wt, bt, padding=1)
        y.backward(flame.tensor(gy, dtype=dt, device="cuda"))

        def close(a, r):
            a = a.detach().float().numpy().astype(np.float64)
            assert np.abs(a - r).max() <= rtol * np.abs(r).max()
        close(y, want)
        close(xt.grad, xr.grad.numpy())
        close(wt.grad, wr.grad.numpy())
        close(bt.grad, gy.sum(axis=(0, 2, 3)))
