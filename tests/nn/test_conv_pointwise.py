"""A plain 1x1 conv (stride 1, no padding, groups 1) is one GEMM batched over the images, with no layout copies:
forward, input and weight gradients against the im2col path in float64 on the cpu, and in float16 / bfloat16 on
cuda against float64."""
import numpy as np
import pytest

from flame_core import backend
from flame_core.dtypes import dtype as parse_dtype
from flame_core.ops import conv as C


@pytest.mark.parametrize("N", [1, 3])
def test_pointwise_matches_im2col_cpu(N):
    rng = np.random.default_rng(N)
    x = rng.standard_normal((N, 7, 5, 6))
    w = rng.standard_normal((9, 7, 1, 1))
    b = rng.standard_normal(9)
    g = C.geometry(x.shape, w.shape, 1, 0, 1, 1)
    assert C.is_pointwise(g)
    want = C.im2col_forward(x, w, g) + b.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(C.conv2d_forward(x, w, g, b), want, rtol=1e-12, atol=1e-12)
    gy = rng.standard_normal((N, 9, 5, 6))
    dx_ref, dw_ref = C.im2col_backward(gy, x, w, g, True, True)
    dx, dw = C.conv2d_backward(gy, x, w, g)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-12, atol=1e-12)
    assert dw.shape == w.shape and dx.shape == x.shape
    assert C.conv2d_backward(gy, x, w, g, need_x=False)[0] is None
    assert C.conv2d_backward(gy, x, w, g, need_w=False)[1] is None


@pytest.mark.gpu
@pytest.mark.parametrize("acc_min", [0, 1 << 40])  # the weight gradient image by image into float32, or batched
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N", [1, 3])
def test_pointwise_cuda_matches_reference(N, dtype, acc_min, monkeypatch):
    monkeypatch.setattr(C.pointwise, "POINTWISE_DW_ACC_MIN", acc_min)  # read by pointwise_backward
    cp = backend.cupy
    rng = np.random.default_rng(7)
    npdt = parse_dtype(dtype).np
    x = rng.standard_normal((N, 40, 9, 11)).astype(npdt).astype(np.float64)
    w = (rng.standard_normal((24, 40, 1, 1)) * 0.2).astype(npdt).astype(np.float64)
    gy = rng.standard_normal((N, 24, 9, 11)).astype(npdt).astype(np.float64)
    g = C.geometry(x.shape, w.shape, 1, 0, 1, 1)
    want_y = C.im2col_forward(x, w, g)
    want_dx, want_dw = C.im2col_backward(gy, x, w, g, True, True)
    xd, wd, gd = (cp.asarray(a.astype(npdt)) for a in (x, w, gy))
    y = cp.asnumpy(C.conv2d_forward(xd, wd, g)).astype(np.float64)
    dx, dw = (cp.asnumpy(a).astype(np.float64) for a in C.conv2d_backward(gd, xd, wd, g))
    tol = 1e-2 if dtype == "bfloat16" else 2e-3
    for got, want, what in ((y, want_y, "y"), (dx, want_dx, "dx"), (dw, want_dw, "dw")):
        assert got.shape == want.shape, what
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), what


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemm_into_a_float32_accumulator(dtype):
    """flame_core.kernels.gemm.matmul of half operands into a float32 `out` (the 1x1 weight gradient's per-image
    sum): out = a @ b, then += a2 @ b2 with beta 1, against float64; a half `out` of another dtype is refused."""
    from flame_core.kernels import gemm
    cp = backend.cupy
    rng = np.random.default_rng(3)
    npdt = parse_dtype(dtype).np
    a, b, a2, b2 = (rng.standard_normal(s).astype(npdt) for s in ((33, 70), (70, 45), (33, 70), (70, 45)))
    acc = cp.empty((33, 45), dtype=np.float32)
    gemm.matmul(cp.asarray(a), cp.asarray(b), out=acc)
    gemm.matmul(cp.asarray(a2), cp.asarray(b2).T.copy().T, out=acc, beta=1.0)
    f = (lambda t: t.astype(np.float64))
    want = f(a) @ f(b) + f(a2) @ f(b2)
    assert np.abs(cp.asnumpy(acc) - want).max() <= 1e-4 * np.abs(want).max()
    other = np.float16 if dtype == "bfloat16" else parse_dtype("bfloat16").np
    with pytest.raises(ValueError, match="out has shape"):
        gemm.matmul(cp.asarray(a), cp.asarray(b), out=cp.empty((33, 45), dtype=other))
