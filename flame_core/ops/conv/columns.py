"""im2col / col2im: a chunk's column matrix (C*KH*KW, P) and its scatter back. On cuda raw kernels
(cuda_src/im2col.cu); the xp reference (as_strided views) is the cpu path and the test oracle."""
import numpy as np

from ... import backend
from .planning import HALF, end_padding, is_pointwise

_KERNEL_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _use_kernel(a):
    if not backend.is_cuda_array(a) or a.dtype.name not in _KERNEL_DTYPES:
        return False
    from ...kernels import loader
    return loader.enabled()


def im2col(x, g, n0, nimg, oh0, nrows):
    """Column matrix (C*KH*KW, nimg*nrows*OW) of a chunk (a view when the conv is 1x1 over one whole image)."""
    if is_pointwise(g) and nrows == g.OH:
        xs = x[n0:n0 + nimg].reshape(nimg, g.C, g.H * g.W)
        return xs[0] if nimg == 1 else backend.xp_of(x).ascontiguousarray(xs.transpose(1, 0, 2)).reshape(g.C, -1)
    if _use_kernel(x):
        return im2col_cuda(x, g, n0, nimg, oh0, nrows)
    return im2col_reference(x, g, n0, nimg, oh0, nrows)


def im2col_reference(x, g, n0, nimg, oh0, nrows):
    xp = backend.xp_of(x)
    pb, pr = end_padding(g)
    xpad = xp.pad(x[n0:n0 + nimg], ((0, 0), (0, 0), (g.ph, pb), (g.pw, pr)))
    s0, s1, s2, s3 = xpad.strides
    base = xpad[:, :, oh0 * g.sh:, :]
    view = xp.lib.stride_tricks.as_strided(
        base, shape=(nimg, g.C, g.KH, g.KW, nrows, g.OW),
        strides=(s0, s1, g.dh * s2, g.dw * s3, g.sh * s2, g.sw * s3))
    return xp.ascontiguousarray(view.transpose(1, 2, 3, 0, 4, 5)).reshape(g.C * g.KH * g.KW, -1)


def col2im(dcols, dx, g, n0, nimg, oh0, nrows, accumulate):
    """dx[n0:n0+nimg] (+)= the sum, per input element, of the column entries that read it."""
    if is_pointwise(g) and nrows == g.OH:
        d = dcols.reshape(g.C, nimg, g.H, g.W).transpose(1, 0, 2, 3)
        if accumulate:
            dx[n0:n0 + nimg] += d
        else:
            dx[n0:n0 + nimg] = d
        return
    if _use_kernel(dx):
        return col2im_cuda(dcols, dx, g, n0, nimg, oh0, nrows, accumulate)
    return col2im_reference(dcols, dx, g, n0, nimg, oh0, nrows, accumulate)


def col2im_reference(dcols, dx, g, n0, nimg, oh0, nrows, accumulate):
    xp = backend.xp_of(dcols)
    acc_dt = np.float32 if dx.dtype in HALF else dx.dtype
    pb, pr = end_padding(g)
    dpad = xp.zeros((nimg, g.C, g.ph + g.H + pb, g.pw + g.W + pr), dtype=acc_dt)
    d6 = dcols.reshape(g.C, g.KH, g.KW, nimg, nrows, g.OW)
    for kh in range(g.KH):
        h0 = oh0 * g.sh + kh * g.dh
        for kw in range(g.KW):
            w0 = kw * g.dw
            dpad[:, :, h0:h0 + g.sh * (nrows - 1) + 1:g.sh, w0:w0 + g.sw * (g.OW - 1) + 1:g.sw] += \
                d6[:, kh, kw].transpose(1, 0, 2, 3)
    res = dpad[:, :, g.ph:g.ph + g.H, g.pw:g.pw + g.W]
    if accumulate:
        res = res + dx[n0:n0 + nimg]
    dx[n0:n0 + nimg] = res.astype(dx.dtype, copy=False)


_ROWS_PER_BLOCK = 8  # IM2COL_ROWS in cuda_src/im2col.cu


def im2col_cuda(x, g, n0, nimg, oh0, nrows):
    from ...kernels import launching, loader, plans
    cp = backend.cupy
    x = cp.ascontiguousarray(x)
    CK = g.C * g.KH * g.KW
    P = nimg * nrows * g.OW
    cols = cp.empty((CK, P), dtype=x.dtype)
    fn = loader.get_function("im2col", "im2col_kernel", x.dtype)
    img = g.C * g.H * g.W
    i32 = np.int32
    launching.launch(fn, (plans.cdiv(P, 256), plans.cdiv(CK, _ROWS_PER_BLOCK)), (256,),
                     (x[n0:n0 + nimg], cols, i32(g.C), i32(g.H), i32(g.W), i32(g.KH), i32(g.KW), i32(g.sh), i32(g.sw),
                      i32(g.ph), i32(g.pw), i32(g.dh), i32(g.dw), i32(g.OW), i32(nrows), i32(oh0), np.int64(P),
                     np.int64(img)))
    return cols


def col2im_cuda(dcols, dx, g, n0, nimg, oh0, nrows, accumulate):
    from ...kernels import launching, loader, plans
    cp = backend.cupy
    dcols = cp.ascontiguousarray(dcols)
    P = nimg * nrows * g.OW
    if accumulate:  # only the input rows this band's output rows read
        h_lo = max(0, oh0 * g.sh - g.ph)
        nh = min(g.H, (oh0 + nrows - 1) * g.sh - g.ph + (g.KH - 1) * g.dh + 1) - h_lo
        if nh <= 0:
            return
    else:  # every row is written (rows no output reads get zeros)
        h_lo, nh = 0, g.H
    total = nimg * g.C * nh * g.W
    fn = loader.get_function("im2col", "col2im_kernel", dx.dtype)
    i32 = np.int32
    launching.launch(fn, (plans.cdiv(total, 256),), (256,),
                     (dcols, dx[n0:n0 + nimg], i32(g.C), i32(g.H), i32(g.W), i32(g.KH), i32(g.KW), i32(g.sh),
                      i32(g.sw), i32(g.ph), i32(g.pw), i32(g.dh), i32(g.dw), i32(g.OW), i32(nrows), i32(oh0),
                      np.int64(P), np.int64(g.C * g.H * g.W), i32(h_lo), i32(nh), np.int64(total),
                      i32(1 if accumulate else 0)))
