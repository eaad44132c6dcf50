"""conv2d on arrays: an implicit GEMM on tensor cores (cuda, float16/bfloat16), else im2col + GEMM (cuBLAS through
flame_core.kernels.gemm on cuda, BLAS on cpu) in bounded-memory chunks.

Implicit GEMM (flame_core/kernels/conv.py, cuda_src/conv_igemm.cu), for groups=1 and every kernel size other than a
plain 1x1: x is copied to NHWC with channels padded to a multiple of 8 and the weights to (O, KH*KW*Cp); the kernel
gathers the column matrix tile by tile into shared memory, so nothing 9x the input exists. Batches are cut into image
chunks whose NHWC copies fit the workspace budget. A channels-last x (flame.channels_last: memory N, H, W, C, with C
a multiple of 8) is that copy already, and so is a channels-last dY: the kernels read them in place
(conv2d_memory_format tells a producer such as F.group_norm_silu which format to write). Per chunk:
    forward     y = conv(x_nhwc, Wp) (+ bias), written NCHW by the kernel's epilogue
    backward    dX = conv(dY_nhwc, W flipped and transposed) at stride 1; strided (dilation 1): one stride-1 conv of
                dY_nhwc per phase of dX (rows a::sh, columns b::sw; dx_phases), no col2im - on the wgmma kernel
                (strides up to 2) every phase in one launch that writes dX itself (one_launch_dx)
                (dilation > 1 with stride > 1 takes the im2col path)
                dW = dY^T @ X_cols, reduced over pixels in slices of fp32 partials (deterministic, no atomics)
`FLAME_CONV_ALGO=im2col` or `=igemm` forces a path (benchmarks and tests compare the two), for every pass or per
pass (`fwd=igemm,dx=igemm,dw=im2col`); `auto` (the default) picks im2col + cuBLAS for small column matrices
(IM2COL_MAX_BYTES, or FLAME_CONV_IM2COL_MAX_MB) and the implicit GEMM above, for each pass.
On a compute capability 9.0 device (H100/H200) the three passes run that implicit GEMM on warpgroup
MMAs (cuda_src/conv_wgmma.cu) instead of mma.sync wherever 'auto' takes the implicit GEMM (WGMMA_AUTO); `wgmma` (or
`fwd=wgmma` etc.) asks for it (RuntimeError on other devices), `igemm` keeps the mma.sync kernels, and arrays the
kernels do not take (cpu, float32, groups > 1, plain 1x1) keep their usual path.

im2col + GEMM: the batch is cut into chunks whose column matrix cols(C*KH*KW, P) fits a workspace budget
(`FLAME_CONV_WORKSPACE_MB`, default 512 on cuda, 128 on cpu): a few whole images, or one band of output rows of one
image when a single image is too big. Per chunk:
    forward     out(O, P) = W(O, C*KH*KW) @ cols                       (grouped: one batched GEMM over groups)
    backward    dW += dY(O, P) @ cols^T ;  dcols = W^T @ dY ;  dX (+)= col2im(dcols)
cols is recomputed in backward rather than saved, so a conv keeps only x and w alive for backward.
On cuda, im2col / col2im are raw kernels (cuda_src/im2col.cu); the xp reference (as_strided views) is the cpu path
and the test oracle.
"""
import math
import os
from collections import namedtuple

import numpy as np

from .. import backend
from .. import dtypes as D
from .. import memory_formats as MF
from .. import threads as _threads
from ..amp import autocast_mode as _amp  # autocast hook: a flag test when off
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..errors import AutogradError, DTypeError, ShapeError, fmt_shape
from ..kernels import gemm as _gemm
from ..tensor import _wrap, check_same_device

Geom = namedtuple("Geom", "N C H W O KH KW sh sw ph pw dh dw OH OW G")
_HALF = (np.dtype(np.float16), D.bfloat16.np)
_KERNEL_DTYPES = ("float32", "float16", "bfloat16", "float64")
_TARGET_COLS = 8192  # whole images are batched into one GEMM until it has this many columns


def _pair(v, name):
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError(f"conv2d: {name} must be an int or a pair, got {v}")
    return v


def geometry(x_shape, w_shape, stride, padding, dilation, groups, pad_end=None):
    """Checked conv2d geometry. padding (numeric) is the top / left padding and, unless pad_end (bottom, right)
    says otherwise, the bottom / right one too. ph / pw are the leading padding; the output size (OH, OW) carries the
    trailing one (every path reads zeros past the input's last row and column)."""
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ShapeError(f"conv2d expects input (N, C, H, W) and weight (O, C/groups, KH, KW), got "
                         f"{fmt_shape(x_shape)} and {fmt_shape(w_shape)}")
    N, C, H, W = x_shape
    O, Cg, KH, KW = w_shape
    sh, sw = _pair(stride, "stride")
    ph, pw = _pair(padding, "padding")
    dh, dw = _pair(dilation, "dilation")
    if groups < 1 or C % groups or O % groups:
        raise ShapeError(f"conv2d: groups={groups} must divide input channels {C} and output channels {O}")
    if Cg * groups != C:
        raise ShapeError(f"conv2d: weight {fmt_shape(w_shape)} expects {Cg * groups} input channels "
                         f"(C/groups={Cg}, groups={groups}) but the input {fmt_shape(x_shape)} has {C}")
    pb, pr = (ph, pw) if pad_end is None else (int(pad_end[0]), int(pad_end[1]))
    if min(sh, sw, dh, dw) < 1 or min(ph, pw, pb, pr) < 0:
        raise ValueError(f"conv2d: stride {sh, sw} and dilation {dh, dw} must be >= 1, padding {ph, pw} "
                         f"(and at the end {pb, pr}) >= 0")
    OH = (H + ph + pb - dh * (KH - 1) - 1) // sh + 1
    OW = (W + pw + pr - dw * (KW - 1) - 1) // sw + 1
    if OH < 1 or OW < 1:
        raise ShapeError(f"conv2d: input {fmt_shape(x_shape)} (padded by {ph, pw}) is smaller than the dilated "
                         f"kernel {(dh * (KH - 1) + 1, dw * (KW - 1) + 1)}")
    return Geom(N, C, H, W, O, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW, groups)


def workspace_bytes(is_cuda):
    mb = os.environ.get("FLAME_CONV_WORKSPACE_MB")
    return int(float(mb) * 2 ** 20) if mb else (512 if is_cuda else 128) * 2 ** 20


def plan(g, itemsize, budget):
    """Chunks (n0, nimg, oh0, nrows) covering the output: whole images when one fits the budget, else row bands."""
    CK = g.C * g.KH * g.KW
    per_row = CK * g.OW * itemsize
    per_img = per_row * g.OH
    if per_img <= budget:
        k = max(1, min(g.N, budget // per_img, math.ceil(_TARGET_COLS / (g.OH * g.OW))))
        return [(n0, min(k, g.N - n0), 0, g.OH) for n0 in range(0, g.N, k)]
    rows = max(1, budget // per_row)
    return [(n, 1, r0, min(rows, g.OH - r0)) for n in range(g.N) for r0 in range(0, g.OH, rows)]


def _use_kernel(a):
    if not backend.is_cuda_array(a) or a.dtype.name not in _KERNEL_DTYPES:
        return False
    from ..kernels import loader
    return loader.enabled()


def _is_pointwise(g):
    return g.KH == g.KW == 1 and g.sh == g.sw == 1 and g.ph == g.pw == 0 and (g.OH, g.OW) == (g.H, g.W)


def _pad_end(g):
    """(bottom, right) padding the output reaches past the input: rows / columns of zeros the references add."""
    return (max(0, (g.OH - 1) * g.sh + g.dh * (g.KH - 1) + 1 - g.H - g.ph),
            max(0, (g.OW - 1) * g.sw + g.dw * (g.KW - 1) + 1 - g.W - g.pw))


# ----------------------------------------------------------------------------- im2col / col2im
def im2col(x, g, n0, nimg, oh0, nrows):
    """Column matrix (C*KH*KW, nimg*nrows*OW) of a chunk (a view when the conv is 1x1 over one whole image)."""
    if _is_pointwise(g) and nrows == g.OH:
        xs = x[n0:n0 + nimg].reshape(nimg, g.C, g.H * g.W)
        return xs[0] if nimg == 1 else backend.xp_of(x).ascontiguousarray(xs.transpose(1, 0, 2)).reshape(g.C, -1)
    if _use_kernel(x):
        return _im2col_cuda(x, g, n0, nimg, oh0, nrows)
    return im2col_reference(x, g, n0, nimg, oh0, nrows)


def im2col_reference(x, g, n0, nimg, oh0, nrows):
    xp = backend.xp_of(x)
    pb, pr = _pad_end(g)
    xpad = xp.pad(x[n0:n0 + nimg], ((0, 0), (0, 0), (g.ph, pb), (g.pw, pr)))
    s0, s1, s2, s3 = xpad.strides
    base = xpad[:, :, oh0 * g.sh:, :]
    view = xp.lib.stride_tricks.as_strided(
        base, shape=(nimg, g.C, g.KH, g.KW, nrows, g.OW),
        strides=(s0, s1, g.dh * s2, g.dw * s3, g.sh * s2, g.sw * s3))
    return xp.ascontiguousarray(view.transpose(1, 2, 3, 0, 4, 5)).reshape(g.C * g.KH * g.KW, -1)


def col2im(dcols, dx, g, n0, nimg, oh0, nrows, accumulate):
    """dx[n0:n0+nimg] (+)= the sum, per input element, of the column entries that read it."""
    if _is_pointwise(g) and nrows == g.OH:
        d = dcols.reshape(g.C, nimg, g.H, g.W).transpose(1, 0, 2, 3)
        if accumulate:
            dx[n0:n0 + nimg] += d
        else:
            dx[n0:n0 + nimg] = d
        return
    if _use_kernel(dx):
        return _col2im_cuda(dcols, dx, g, n0, nimg, oh0, nrows, accumulate)
    return col2im_reference(dcols, dx, g, n0, nimg, oh0, nrows, accumulate)


def col2im_reference(dcols, dx, g, n0, nimg, oh0, nrows, accumulate):
    xp = backend.xp_of(dcols)
    acc_dt = np.float32 if dx.dtype in _HALF else dx.dtype
    pb, pr = _pad_end(g)
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


def _im2col_cuda(x, g, n0, nimg, oh0, nrows):
    from ..kernels import launching, loader, plans
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


def _col2im_cuda(dcols, dx, g, n0, nimg, oh0, nrows, accumulate):
    from ..kernels import launching, loader, plans
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


# ----------------------------------------------------------------------------- GEMMs
def _mm(a, b, out=None):
    """a @ b (2-D or batched) into `out`; NumPy half types multiply in float32. CuPy float32/float16/bfloat16 go
    through flame_core.kernels.gemm (cuBLAS on the current stream): CuPy's own matmul refuses to run while a CUDA
    graph is being captured, and a graphed training step convolves (SDXL's UNet)."""
    xp = backend.xp_of(a)
    if xp is np and a.dtype in _HALF:
        r = _threads.matmul(a.astype(np.float32), b.astype(np.float32))
        if out is None:
            return r.astype(a.dtype)
        out[...] = r
        return out
    if xp is np:
        return _threads.matmul(a, b, out=out)
    if a.dtype == b.dtype and _gemm.supported(a.dtype):
        return _gemm.matmul(a, b, out=out)
    if out is None:  # float64 (not capturable; training runs in float32 or lower)
        return xp.matmul(a, b)
    return xp.matmul(a, b, out=out)


def _forward_chunk(w3, cols, out, g):
    """out(O, P) = W @ cols, group by group in one (batched) GEMM. w3 is (G, O/G, C/G*KH*KW)."""
    if g.G == 1:
        _mm(w3[0], cols, out)
    else:
        _mm(w3, cols.reshape(g.G, -1, cols.shape[1]), out.reshape(g.G, -1, cols.shape[1]))


def conv2d_forward(x, w, g, bias=None, emb=None, res=None):
    """y (N, O, OH, OW) = conv2d(x, w) (+ bias (O,)) (+ emb (N, O) over every pixel) (+ res, y's shape), on arrays.
    The wgmma kernel adds emb and res in its epilogue; the other paths add them to the fresh output after."""
    xp = backend.xp_of(x)
    ig = use_igemm(x, g)
    if not (ig and _reads_in_place(x, g.C)):  # the implicit GEMM reads a channels-last x as its NHWC operand
        x = xp.ascontiguousarray(x)
    w = xp.ascontiguousarray(w)
    c = (lambda a: None if a is None else xp.ascontiguousarray(a))
    if ig:
        if use_wgmma(x, g):
            return _igemm_forward(x, w, g, c(bias), c(emb), c(res), wgmma=True)
        y = _igemm_forward(x, w, g, c(bias), wgmma=False)
    else:
        y = _pointwise_forward(x, w, g) if _is_pointwise(g) and g.G == 1 else _im2col_forward(x, w, g)
        if bias is not None:
            y += bias.reshape(1, -1, 1, 1)
    if emb is not None:
        y += emb.reshape(g.N, g.O, 1, 1)
    if res is not None:
        y += res
    return y


def _pointwise_forward(x, w, g):
    """A plain 1x1 conv: y[n] (O, H*W) = W (O, C) @ x[n] (C, H*W), one GEMM batched over the images (the weight
    broadcast), no copies."""
    y = backend.xp_of(x).empty((g.N, g.O, g.OH, g.OW), dtype=x.dtype)
    _mm(w.reshape(g.O, g.C), x.reshape(g.N, g.C, g.H * g.W), y.reshape(g.N, g.O, g.H * g.W))
    return y


# a 1x1 weight gradient of at least this many per-image products (N * O * C) accumulates image by image into one
# float32 sum: measured on an H200 (95187a4), 2x2560x32^2 -> 1280: 0.067 -> 0.054 ms, 2x960x128^2 -> 320: 0.064 ->
# 0.056, but 2x320x64^2 -> 640 (409,600 products): 0.021 -> 0.025 - there the batched GEMM's parallelism wins
POINTWISE_DW_ACC_MIN = 1 << 19


def _pointwise_backward(gy, x, w, g, need_x, need_w):
    """(dx, dw) of a plain 1x1 conv: dx[n] = W^T @ dy[n] (one batched GEMM); dw = sum_n dy[n] @ x[n]^T (one GEMM for
    a single image; on a GPU in half precision, from POINTWISE_DW_ACC_MIN products on, one GEMM per image
    accumulating into one float32 sum, rounded once; else one batched GEMM whose per-image products are summed in
    float32)."""
    xp = backend.xp_of(x)
    gy3 = gy.reshape(g.N, g.O, g.H * g.W)
    dx = dw = None
    if need_x:
        dx = xp.empty(x.shape, dtype=x.dtype)
        _mm(w.reshape(g.O, g.C).T, gy3, dx.reshape(g.N, g.C, g.H * g.W))
    if need_w:
        x3 = x.reshape(g.N, g.C, g.H * g.W)
        if g.N == 1:
            dw = _mm(gy3[0], x3[0].T)
        elif (xp is not np and w.dtype in _HALF and _gemm.supported(w.dtype)
              and g.N * g.O * g.C >= POINTWISE_DW_ACC_MIN):
            # one GEMM per image into one float32 accumulator (beta = 1): no per-image products rounded and summed
            acc = xp.empty((g.O, g.C), dtype=np.float32)
            for n in range(g.N):
                _gemm.matmul(gy3[n], x3[n].T, out=acc, beta=0.0 if n == 0 else 1.0)
            dw = acc.astype(w.dtype)
        else:
            acc = np.float32 if w.dtype in _HALF else w.dtype
            dw = _mm(gy3, x3.transpose(0, 2, 1)).sum(axis=0, dtype=acc).astype(w.dtype, copy=False)
        dw = dw.reshape(w.shape)
    return dx, dw


def _im2col_forward(x, w, g):
    xp = backend.xp_of(x)
    w3 = w.reshape(g.G, g.O // g.G, -1)
    y = xp.empty((g.N, g.O, g.OH, g.OW), dtype=x.dtype)
    budget = workspace_bytes(xp is not np)
    for n0, nimg, oh0, nrows in plan(g, x.itemsize, budget):
        cols = im2col(x, g, n0, nimg, oh0, nrows)
        P = cols.shape[1]
        if nimg == 1 and nrows == g.OH:
            _forward_chunk(w3, cols, y[n0].reshape(g.O, P), g)
            continue
        out = xp.empty((g.O, P), dtype=x.dtype)
        _forward_chunk(w3, cols, out, g)
        if nrows == g.OH:
            y[n0:n0 + nimg] = out.reshape(g.O, nimg, g.OH, g.OW).transpose(1, 0, 2, 3)
        else:
            y[n0, :, oh0:oh0 + nrows] = out.reshape(g.O, nrows, g.OW)
        del cols, out
    return y


def _grad_chunk(gy, g, n0, nimg, oh0, nrows):
    """dY of a chunk as an (O, P) matrix."""
    xp = backend.xp_of(gy)
    if nrows == g.OH:
        if nimg == 1:
            return gy[n0].reshape(g.O, -1)
        return xp.ascontiguousarray(gy[n0:n0 + nimg].reshape(nimg, g.O, -1).transpose(1, 0, 2)).reshape(g.O, -1)
    return xp.ascontiguousarray(gy[n0, :, oh0:oh0 + nrows]).reshape(g.O, -1)


def conv2d_backward(gy, x, w, g, need_x=True, need_w=True):
    """(dx, dw) of conv2d for output gradient gy (either may be None when not needed), on arrays."""
    if not (need_x or need_w):
        return None, None
    xp = backend.xp_of(x)
    w = xp.ascontiguousarray(w)
    if _is_pointwise(g) and g.G == 1:
        return _pointwise_backward(xp.ascontiguousarray(gy), xp.ascontiguousarray(x), w, g, need_x, need_w)
    # the transposed conv is a conv at stride 1, and one conv per phase of dx when strided (dilation 1)
    ig_x = need_x and (g.sh == g.sw == 1 or strided_dx(g)) and use_igemm(x, g, "dx")
    ig_w = need_w and use_igemm(x, g, "dw")
    dx = dw = None
    if ig_x or ig_w:  # channels-last x / dy are read in place as the kernels' NHWC operands
        dx, dw = _igemm_backward(gy if _reads_in_place(gy, g.O) else xp.ascontiguousarray(gy),
                                 x if not ig_w or _reads_in_place(x, g.C) else xp.ascontiguousarray(x), w, g, ig_x,
                                 ig_w)
    if (need_x and not ig_x) or (need_w and not ig_w):
        dx2, dw2 = _im2col_backward(xp.ascontiguousarray(gy), xp.ascontiguousarray(x), w, g, need_x and not ig_x,
                                    need_w and not ig_w)
        dx = dx2 if dx is None else dx
        dw = dw2 if dw is None else dw
    return dx, dw


def _im2col_backward(gy, x, w, g, need_x, need_w):
    xp = backend.xp_of(x)
    w3 = w.reshape(g.G, g.O // g.G, -1)
    chunks = plan(g, x.itemsize, workspace_bytes(xp is not np) // 2)
    banded = any(nrows != g.OH for _, _, _, nrows in chunks)
    dx = (xp.zeros if banded else xp.empty)(x.shape, dtype=x.dtype) if need_x else None
    dw = None
    acc_dt = np.float32 if w.dtype in _HALF else w.dtype
    w3t = w3.transpose(0, 2, 1)  # (G, CgK, Og)
    for n0, nimg, oh0, nrows in chunks:
        gc = _grad_chunk(gy, g, n0, nimg, oh0, nrows)  # (O, P)
        P = gc.shape[1]
        if need_w:
            cols = im2col(x, g, n0, nimg, oh0, nrows)
            if g.G == 1:
                part = _mm(gc, cols.T)[None]
            else:
                part = _mm(gc.reshape(g.G, -1, P), cols.reshape(g.G, -1, P).transpose(0, 2, 1))
            if len(chunks) == 1:
                dw = part
            elif dw is None:
                dw = part.astype(acc_dt)
            else:
                dw += part
            del cols, part
        if need_x:
            if g.G == 1:
                dcols = _mm(w3t[0], gc)
            else:
                dcols = _mm(w3t, gc.reshape(g.G, -1, P)).reshape(-1, P)
            col2im(dcols, dx, g, n0, nimg, oh0, nrows, accumulate=banded)
            del dcols
    if dw is not None:
        dw = dw.astype(w.dtype, copy=False).reshape(w.shape)
    return dx, dw


# ----------------------------------------------------------------------------- implicit GEMM (cuda, fp16 / bf16)
# Column matrices up to this size take im2col + cuBLAS in "auto" mode. Measured on the H100 (bench/conv.py --variant,
# 2026-11-23): SDXL 2x640x64x64 (94 MB of columns) im2col 0.57x cuDNN vs implicit GEMM 0.50x; 2x1280x32x32 (47 MB)
# 0.85x vs 0.46x; 2x320x128x128 (189 MB) 0.39x vs 0.47x; the VAE shapes (600 MB and more) 0.39x vs 0.54x.
# 64 MB since 2026-11-26 (H200, bench/sdxl_lora.py --graph): the 90 MiB column matrix of SDXL's 1x320x128x128 convs
# was alive at the checkpointed LoRA step's peak; with the implicit GEMM there the step took 145.0 ms instead of
# 147.6 and peaked 30 MB lower.
IM2COL_MAX_BYTES = 64 << 20
PASSES = ("fwd", "dx", "dw")
_ALGOS = ("auto", "im2col", "igemm", "wgmma")  # wgmma: the Hopper implicit GEMM (cuda_src/conv_wgmma.cu)
# 'auto' runs the wgmma kernel wherever it runs the implicit GEMM on a compute capability 9.0 device
WGMMA_AUTO = True


def conv_algo(pass_="fwd"):
    """The algorithm FLAME_CONV_ALGO asks for one pass (fwd, dx or dw): 'auto' (default), 'im2col', 'igemm' (the
    mma.sync implicit GEMM) or 'wgmma' (the implicit GEMM on sm_90a warpgroup MMAs).
    The variable holds one name for every pass, or per-pass settings such as 'fwd=igemm,dx=igemm,dw=im2col'
    (separated by ',', ';', '/' or '+'; passes not named are 'auto')."""
    spec = os.environ.get("FLAME_CONV_ALGO", "auto").strip().lower()
    if "=" not in spec:
        algos = dict.fromkeys(PASSES, spec or "auto")
    else:
        algos = dict.fromkeys(PASSES, "auto")
        for item in spec.replace(";", ",").replace("/", ",").replace("+", ",").split(","):
            k, _, v = item.strip().partition("=")
            if k.strip() not in PASSES:
                raise ValueError(f"FLAME_CONV_ALGO={spec!r}: {k.strip()!r} is not a pass ({', '.join(PASSES)})")
            algos[k.strip()] = v.strip()
    for p, algo in algos.items():  # every pass checked, so that a bad backward setting fails at the forward
        if algo not in _ALGOS:
            raise ValueError(f"FLAME_CONV_ALGO={spec!r}: the algorithm must be one of {', '.join(_ALGOS)}")
    return algos[pass_]


def im2col_max_bytes():
    """IM2COL_MAX_BYTES, or FLAME_CONV_IM2COL_MAX_MB (benchmarks: where 'auto' switches to the implicit GEMM)."""
    mb = os.environ.get("FLAME_CONV_IM2COL_MAX_MB")
    return int(float(mb) * 2 ** 20) if mb else IM2COL_MAX_BYTES


def tuned(g, pass_):
    """The measured table's entry for one pass of geometry g (flame_core/kernels/conv_table.py: {'algo': 'im2col' or
    'wgmma', 'plan': 'TILE:sN'}) when FLAME_CONV_ALGO leaves the pass 'auto'; None otherwise or when the geometry
    was not measured on this kind of GPU."""
    if conv_algo(pass_) != "auto":
        return None
    from ..kernels import conv_table
    return conv_table.lookup(pass_, g)


def tuned_plan(g, pass_):
    """The measured wgmma plan ('TILE' or 'TILE:sN') of one pass, or None (the waves model of wgmma_plan picks)."""
    e = tuned(g, pass_)
    return e.get("plan") if e is not None and e["algo"] == "wgmma" else None


def use_igemm(x, g, pass_="fwd"):
    """Whether one pass of conv2d on x (fwd, dx or dw) runs the implicit-GEMM kernels: a CuPy float16/bfloat16
    array, groups 1, not a plain 1x1 (cuBLAS on the input itself is the better GEMM there), sizes within the
    kernels' int32 indexing and grid limits, kernels enabled, and the pass's FLAME_CONV_ALGO 'igemm' (or 'wgmma'
    for fwd: see use_wgmma), or 'auto' (default) with a column matrix over IM2COL_MAX_BYTES. (dx with stride > 1
    and dilation > 1 takes im2col whatever this says.)"""
    if x.dtype not in _HALF or g.G != 1 or _is_pointwise(g) or not backend.is_cuda_array(x):
        return False
    algo = conv_algo(pass_)
    if algo == "im2col":
        return False
    if algo == "auto":
        entry = tuned(g, pass_)
        if entry is not None:
            if entry["algo"] == "im2col":
                return False
        elif g.N * g.OH * g.OW * g.C * g.KH * g.KW * x.itemsize <= im2col_max_bytes():
            return False  # a small column matrix: im2col + cuBLAS measured faster (SDXL 64x64 / 32x32 layers)
    if max(g.C, g.O) > 65535 or g.KH * g.KW * (max(g.C, g.O) + 8) >= 2 ** 31 \
            or max(g.H * g.W, g.OH * g.OW) >= 2 ** 31 - 4096:
        return False
    from ..kernels import loader
    return loader.enabled()


def use_wgmma(x, g, pass_="fwd"):
    """Whether one pass of conv2d on x runs cuda_src/conv_wgmma.cu - the forward ('fwd'), the input gradient ('dx',
    stride 1: a conv of dy) or the weight gradient ('dw'): use_igemm(x, g, pass_), for fwd / dx a kernel of at most
    32 taps (larger ones take the mma.sync implicit GEMM) and one image's NHWC copy under 2 GiB (32-bit row offsets),
    for dw 32-bit column offsets, and FLAME_CONV_ALGO's 'wgmma' for the pass, or 'auto' on a compute
    capability 9.0 device (WGMMA_AUTO). Raises RuntimeError when 'wgmma' is asked for on a device that cannot run
    sm_90a code."""
    from ..kernels import conv as K
    algo = conv_algo(pass_)
    if algo not in ("wgmma", "auto") or (algo == "auto" and not WGMMA_AUTO):
        return False
    if pass_ == "dx" and not (g.sh == g.sw == 1 or strided_dx(g)):
        return False
    if not use_igemm(x, g, pass_) or (pass_ != "dw" and g.KH * g.KW > K.WGMMA_MAX_TAPS):
        return False
    if pass_ == "dw":
        if not K.wgmma_dw_fits(g.H, g.W, K.round8(g.C), g.KH, g.KW, g.dh, g.dw) \
                or max(g.H * g.W * K.round8(g.C), g.OH * g.OW * K.round8(g.O)) >= 2 ** 31:
            return False  # one image's x or dY past 32-bit element offsets
    else:
        src_pixels, src_channels = (g.H * g.W, g.C) if pass_ == "fwd" else (g.OH * g.OW, g.O)
        if src_pixels * K.round8(src_channels) * x.itemsize >= 2 ** 31 - 2 ** 20:
            return False
    if not K.wgmma_available():
        if algo == "auto":
            return False
        raise RuntimeError(f"FLAME_CONV_ALGO={pass_}=wgmma: the wgmma conv kernel (cuda_src/conv_wgmma.cu) needs a "
                           f"compute capability 9.0 GPU (H100/H200); this device is not one - unset it or use "
                           f"{pass_}=igemm")
    return True


def _image_chunks(N, per_image, budget, per_pixel_rows):
    """(n0, k) image ranges whose NHWC copies (per_image bytes each) fit the budget; at least one image each."""
    k = max(1, min(N, 65535, budget // max(1, per_image), (2 ** 31 - 4096) // max(1, per_pixel_rows)))
    return [(n0, min(k, N - n0)) for n0 in range(0, N, k)]


def _nhwc(a, Rp):
    """The kernels' (N, H*W, Rp) channel-last operand of `a` (N, C, H, W): a view when `a` is channels-last (memory
    N, H, W, C) with C = Rp, else K.to_nhwc's copy (channels C..Rp-1 zero)."""
    from ..kernels import conv as K
    if a.ndim == 4 and a.shape[1] == Rp and MF.is_channels_last(a):
        N, C, H, W = a.shape
        return a.transpose(0, 2, 3, 1).reshape(N, H * W, C)
    return K.to_nhwc(a, Rp)


def _reads_in_place(a, channels):
    """Whether the implicit-GEMM kernels read array `a` (channels-last, `channels` a multiple of 8) without a copy."""
    from ..kernels import conv as K
    return K.round8(channels) == channels and MF.is_channels_last(a)


def _igemm_forward(x, w, g, bias, emb=None, res=None, wgmma=False):
    """The implicit-GEMM forward, image chunk by chunk, on the wgmma kernel (`wgmma`: use_wgmma's answer) or the
    mma.sync one; emb / res (the wgmma kernel's epilogue adds) chunked too."""
    from ..kernels import conv as K
    Cp = K.round8(g.C)
    wp = K.pack_weight(w, Cp)  # (O, KH*KW*Cp)
    y = K.empty((g.N, g.O, g.OH, g.OW), x.dtype)
    budget = workspace_bytes(True)
    plan = tuned_plan(g, "fwd") if wgmma else None
    for n0, k in _image_chunks(g.N, g.H * g.W * Cp * x.itemsize, budget, max(g.H * g.W, g.OH * g.OW)):
        xt = _nhwc(x[n0:n0 + k], Cp)  # (k, H*W, Cp): a view of a channels-last x
        cg = K.ConvGeom(k, g.H, g.W, Cp, g.O, g.OH, g.OW, g.KH, g.KW, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
        if wgmma:
            K.conv_nhwc_wgmma(xt, wp, y[n0:n0 + k], cg, bias, plan=plan, emb=None if emb is None else emb[n0:n0 + k],
                              res=None if res is None else res[n0:n0 + k])
        else:
            K.conv_nhwc(xt, wp, y[n0:n0 + k], cg, bias, budget)
        del xt
    return y


DxPhase = namedtuple("DxPhase", "a b kh kw ph pw OH OW")


def strided_dx(g):
    """Whether the input gradient of a strided conv goes through dx_phases (dilation 1, groups 1)."""
    return (g.sh > 1 or g.sw > 1) and g.dh == g.dw == 1 and g.G == 1


def one_launch_dx(g):
    """Whether a strided conv's dx on the wgmma kernel runs every phase in one launch (conv_dx_phased_wgmma: strides
    up to 2) rather than one launch per phase (phase_dx)."""
    return strided_dx(g) and g.sh <= 2 and g.sw <= 2


def dx_phases(g):
    """The input gradient of a strided conv (dilation 1) as stride-1 convs of dy, one per phase (a, b) of dx: rows
    a::sh and columns b::sw of dx come from the taps kh = a + ph (mod sh) and kw = b + pw (mod sw), taken largest
    first. A stride-1 conv reads its input at i - p + j for tap j; phase row i reads dy row i + (a + ph - kh_j) / sh,
    so its taps are those kh in that order and its padding p = -(a + ph - kh_0) / sh (any sign: the kernels zero-fill
    outside dy). Phases with no tap or no rows are left out: their part of dx is zero."""
    def axis(stride, pad, taps, size):
        out = []
        for a in range(stride):
            T = [k for k in range(taps - 1, -1, -1) if (a + pad - k) % stride == 0]
            rows = -(-(size - a) // stride)
            if T and rows > 0:
                out.append((a, tuple(T), -((a + pad - T[0]) // stride), rows))
        return out
    return [DxPhase(a, b, ta, tb, pa, pb, ra, rb)
            for a, ta, pa, ra in axis(g.sh, g.ph, g.KH, g.H) for b, tb, pb, rb in axis(g.sw, g.pw, g.KW, g.W)]


def pack_phase_weight(w, ph, sh, sw, Op):
    """The packed (C, len(kh)*len(kw)*Op) weights of one dx phase of a conv of stride (sh, sw): out[c, (i*len(kw) +
    j)*Op + o] = w[o, c, ph.kh[i], ph.kw[j]] (o < O, else 0). The taps are strided slices (views, no index arrays:
    no host-to-device copy, so a CUDA graph can capture it)."""
    xp = backend.xp_of(w)
    O, C = w.shape[:2]
    sub = w[:, :, ph.kh[0]::-sh, ph.kw[0]::-sw].transpose(1, 2, 3, 0)  # (C, ka, kb, O): taps largest first
    out = xp.zeros((C, len(ph.kh), len(ph.kw), Op), dtype=w.dtype)
    out[..., :O] = sub
    return out.reshape(C, -1)


def phase_dx(gt, w, g, dx, Op, conv):
    """dx (k images) of a strided conv from gt = dy channel-last (k, OH*OW, Op): one stride-1 conv per phase of
    dx_phases, `conv(gt, wp, out, cg)` (the kernels' conv_nhwc signature) into a (k, C, rows, cols) temporary.
    On a GPU with strides up to 2 the temporaries are woven into dx by one pass (conv_dx_interleave, zeros where a
    phase has no tap); otherwise each is written to dx[:, :, a::sh, b::sw], after zeroing dx when a phase has no
    tap. Every element of dx is written either way."""
    from ..kernels import conv as K
    xp = backend.xp_of(gt)
    k = gt.shape[0]
    weave = backend.is_cuda_array(dx) and g.sh <= 2 and g.sw <= 2
    if not weave and len(dx_phases(g)) < g.sh * g.sw:
        dx[...] = 0
    outs = {}
    for ph in dx_phases(g):
        wp = pack_phase_weight(w, ph, g.sh, g.sw, Op)
        cg = K.ConvGeom(k, g.OH, g.OW, Op, g.C, ph.OH, ph.OW, len(ph.kh), len(ph.kw), 1, 1, ph.ph, ph.pw, 1, 1)
        out = xp.empty((k, g.C, ph.OH, ph.OW), dtype=dx.dtype)
        conv(gt, wp, out, cg)
        del wp
        if weave:
            outs[ph.a, ph.b] = out
        else:
            dx[:, :, ph.a::g.sh, ph.b::g.sw] = out
        del out
    if weave:
        K.dx_interleave(outs, dx, g.sh, g.sw)


def _igemm_backward(gy, x, w, g, need_x, need_w):
    """dx and dw by the implicit-GEMM kernels. dx at stride 1 is one conv of dy (the transposed conv is then a
    conv); a strided dx (dilation 1) is one stride-1 conv per phase of dx: on the wgmma kernel (strides up to 2) all
    phases in one launch writing dx directly (conv_dx_phased_wgmma), else one launch each (phase_dx)."""
    from ..kernels import conv as K
    Cp, Op = K.round8(g.C), K.round8(g.O)
    budget = workspace_bytes(True)
    per_image = ((g.H * g.W * Cp if need_w else 0) + g.OH * g.OW * Op) * x.itemsize
    wgmma_w = need_w and use_wgmma(x, g, "dw")
    # the wgmma dw kernel's offsets in a chunk's x and dY copies are 32-bit: chunks of at most 2 GiB keep them so
    chunks = _image_chunks(g.N, per_image, min(budget, 2 << 30) if wgmma_w else budget, max(g.H * g.W, g.OH * g.OW))
    phased = need_x and strided_dx(g)
    wgmma_x = need_x and use_wgmma(x, g, "dx")
    fused = wgmma_x and one_launch_dx(g)  # every phase in one launch (conv_dx_phased_wgmma)
    dx = K.empty(x.shape, x.dtype) if need_x else None
    wd = K.pack_weight_dx(w, Op) if need_x and (fused or not phased) else None  # (C, KH*KW*Op)
    if fused:
        phases = dx_phases(g)
        if len(phases) < g.sh * g.sw:  # a phase with no tap: its part of dx is zero
            dx[...] = 0
    dw = K.empty(w.shape, w.dtype) if need_w else None
    acc32 = K.empty(w.shape, np.float32) if need_w and len(chunks) > 1 else None  # dw summed over chunks
    # dx: the wgmma kernel with the measured plan, else the mma.sync kernel
    conv_x = (lambda a, b, c, d: K.conv_nhwc_wgmma(a, b, c, d, None, budget, plan=tuned_plan(g, "dx"))) \
        if wgmma_x else (lambda a, b, c, d: K.conv_nhwc(a, b, c, d, None, budget))
    for i, (n0, k) in enumerate(chunks):
        gt = _nhwc(gy[n0:n0 + k], Op)  # (k, OH*OW, Op)
        if fused:
            cg = K.ConvGeom(k, g.OH, g.OW, Op, g.C, g.H, g.W, g.KH, g.KW, g.sh, g.sw, g.ph, g.pw, 1, 1)
            K.conv_dx_phased_wgmma(gt, wd, dx[n0:n0 + k], cg, phases, plan=tuned_plan(g, "dx"))
        elif phased:
            phase_dx(gt, w, g, dx[n0:n0 + k], Op, conv_x)
        elif need_x:  # dx = conv(dy, w flipped), stride 1, padding d*(K-1) - p
            cg = K.ConvGeom(k, g.OH, g.OW, Op, g.C, g.H, g.W, g.KH, g.KW, 1, 1,
                            g.dh * (g.KH - 1) - g.ph, g.dw * (g.KW - 1) - g.pw, g.dh, g.dw)
            conv_x(gt, wd, dx[n0:n0 + k], cg)
        if need_w:
            xt = _nhwc(x[n0:n0 + k], Cp)  # (k, H*W, Cp)
            cg = K.ConvGeom(k, g.H, g.W, Cp, g.O, g.OH, g.OW, g.KH, g.KW, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
            if wgmma_w:
                K.conv_dw_nhwc_wgmma(gt, xt, cg, g.C, dw=dw if i == len(chunks) - 1 else None, acc32=acc32,
                                     accumulate=i > 0, budget=budget, plan=tuned_plan(g, "dw"))
            else:
                K.conv_dw_nhwc(gt, xt, cg, g.C, dw=dw if i == len(chunks) - 1 else None, acc32=acc32,
                               accumulate=i > 0, budget=budget)
            del xt
        del gt
    return dx, dw


def bias_grad(gy):
    """Sum of gy over (N, OH, OW), accumulated in float32 for half types."""
    if gy.dtype in _HALF:
        return gy.sum(axis=(0, 2, 3), dtype=np.float32).astype(gy.dtype)
    return gy.sum(axis=(0, 2, 3))


def image_bias_grad(gy):
    """Sum of gy over (OH, OW) per image and channel (N, O), accumulated in float32 for half types."""
    if gy.dtype in _HALF:
        return gy.sum(axis=(2, 3), dtype=np.float32).astype(gy.dtype)
    return gy.sum(axis=(2, 3))


# ----------------------------------------------------------------------------- autograd
class Conv2d(Function):
    """y = conv(x, w) (+ b[o]) (+ e[n, o]) (+ r): conv2d and pad_conv2d (e, r None) and conv2d_add."""
    @staticmethod
    def forward(ctx, x, w, b, e, r, g):
        d = (lambda t: None if t is None else t._data)
        y = conv2d_forward(x._data, w._data, g, d(b), d(e), d(r))
        ctx.save_for_backward(x, w)
        ctx.g = g
        return _wrap(y)

    @staticmethod
    def backward(ctx, gy):
        if state.enabled:
            raise AutogradError("conv2d has no double backward (its backward runs on raw arrays); "
                                "create_graph=True through a convolution is not supported")
        x, w = ctx.saved_tensors
        nx, nw, nb, ne, nr = ctx.needs_input_grad[:5]
        dx, dw = conv2d_backward(gy._data, x._data, w._data, ctx.g, need_x=nx, need_w=nw)
        db = bias_grad(gy._data) if nb else None
        de = image_bias_grad(gy._data) if ne else None
        w_ = (lambda a: None if a is None else _wrap(a))
        return w_(dx), w_(dw), w_(db), w_(de), (gy if nr else None), None


def _same_padding(x, w, stride, dilation):
    """PyTorch's padding='same' (stride 1): total padding d*(k-1); the odd extra pixel goes right/bottom."""
    if _pair(stride, "stride") != (1, 1):
        raise ValueError("conv2d: padding='same' is only supported with stride 1")
    dh, dw = _pair(dilation, "dilation")
    th, tw = dh * (w.shape[2] - 1), dw * (w.shape[3] - 1)
    lo = (th // 2, tw // 2)
    if th % 2 or tw % 2:
        from .indexing import pad
        x = pad(x, (tw // 2, tw - tw // 2, th // 2, th - th // 2))
        return x, (0, 0)
    return x, lo


def checked_inputs(op, input, weight, bias):
    """(input with a batch dim, weight, bias, whether the input had none) for convolution `op`, after what every
    convolution checks first: one device, autocast's cast, floating point dtypes, the same dtype for all."""
    check_same_device(op, input, weight, bias)
    if _amp.active:
        input, weight, bias = _amp.cast_inputs("lower", input, weight, bias)
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and not t.dtype.is_floating_point:
            raise DTypeError(f"{op}: {name} must be floating point, got {t.dtype}")
    if input.dtype != weight.dtype or (bias is not None and bias.dtype != input.dtype):
        raise DTypeError(f"{op}: input ({input.dtype}), weight ({weight.dtype})"
                         + (f" and bias ({bias.dtype})" if bias is not None else "") + " must have the same dtype")
    unbatched = input.ndim == 3
    return (input.unsqueeze(0) if unbatched else input), weight, bias, unbatched


def pad_conv2d(input, weight, bias=None, pad=(0, 0, 0, 0), stride=1, dilation=1, groups=1):
    """conv2d(F.pad(input, pad), weight, bias, stride, 0, dilation, groups) with the zero padding folded into the
    convolution: `pad` in F.pad's order (left, right, top, bottom), each >= 0. Nothing padded is made - every path
    reads zeros outside the input - and the input gradient has the input's shape. The LDM VAE encoder's downsample
    is pad (0, 1, 0, 1) at stride 2."""
    if len(pad) != 4 or any(int(p) != p or p < 0 for p in pad):
        raise ValueError(f"pad_conv2d: pad must be four integers >= 0 (left, right, top, bottom), got {tuple(pad)}")
    input, weight, bias, unbatched = checked_inputs("pad_conv2d", input, weight, bias)
    pl, pr, pt, pb = (int(p) for p in pad)
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, (pt, pl), dilation, int(groups), pad_end=(pb, pr))
    if bias is not None and tuple(bias.shape) != (g.O,):
        raise ShapeError(f"pad_conv2d: bias of shape {fmt_shape(bias.shape)} for {g.O} output channels")
    y = Conv2d.apply(input, weight, bias, None, None, g)
    return y.squeeze(0) if unbatched else y


def _padding(op, input, weight, stride, padding, dilation):
    """(input, numeric padding) for conv2d's padding: an int, a pair, 'valid' or 'same'."""
    if isinstance(padding, str):
        if padding == "valid":
            return input, 0
        if padding == "same":
            return _same_padding(input, weight, stride, dilation)
        raise ValueError(f"{op}: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    return input, padding


def conv2d_add(input, weight, bias=None, add=None, residual=None, stride=1, padding=0, dilation=1, groups=1):
    """conv2d(input, weight, bias, stride, padding, dilation, groups) + add[:, :, None, None] + residual, the two
    adds made by the convolution's epilogue where the wgmma kernel runs (one pass over the output instead of three)
    and on the fresh output elsewhere. add: (N, O), a per-image bias (the UNet ResBlock's time embedding);
    residual: the output's shape (a skip connection); either may be None. Gradients: add's is the output gradient
    summed over the pixels, residual's the output gradient itself. An add or residual of another dtype than the
    convolution's (autocast) is added after it with the usual type promotion."""
    input, weight, bias, unbatched = checked_inputs("conv2d_add", input, weight, bias)
    if unbatched:
        raise ShapeError(f"conv2d_add: input must be (N, C, H, W), got {fmt_shape(input.shape[1:])}")
    input, padding = _padding("conv2d_add", input, weight, stride, padding, dilation)
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, padding, dilation, int(groups))
    if bias is not None and tuple(bias.shape) != (g.O,):
        raise ShapeError(f"conv2d_add: bias of shape {fmt_shape(bias.shape)} for {g.O} output channels")
    check_same_device("conv2d_add", input, add, residual)
    if add is not None and tuple(add.shape) != (g.N, g.O):
        raise ShapeError(f"conv2d_add: add of shape {fmt_shape(add.shape)}; it must be (N, O) = ({g.N}, {g.O})")
    if residual is not None and tuple(residual.shape) != (g.N, g.O, g.OH, g.OW):
        raise ShapeError(f"conv2d_add: residual of shape {fmt_shape(residual.shape)} for an output of shape "
                         f"{fmt_shape((g.N, g.O, g.OH, g.OW))}")
    e = add if add is None or add.dtype == input.dtype else None
    r = residual if residual is None or residual.dtype == input.dtype else None
    y = Conv2d.apply(input, weight, bias, e, r, g)
    if add is not None and e is None:
        y = y + add[:, :, None, None]
    if residual is not None and r is None:
        y = y + residual
    return y


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D convolution (cross-correlation), PyTorch's F.conv2d: input (N, C, H, W) or (C, H, W),
    weight (O, C/groups, KH, KW); padding an int, a pair, 'valid' or 'same'."""
    input, weight, bias, unbatched = checked_inputs("conv2d", input, weight, bias)
    input, padding = _padding("conv2d", input, weight, stride, padding, dilation)
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, padding, dilation, int(groups))
    if bias is not None and tuple(bias.shape) != (g.O,):
        raise ShapeError(f"conv2d: bias of shape {fmt_shape(bias.shape)} for {g.O} output channels")
    y = Conv2d.apply(input, weight, bias, None, None, g)
    return y.squeeze(0) if unbatched else y


def conv2d_memory_format(input, weight, stride=1, padding=0, dilation=1, groups=1):
    """The memory format in which conv2d(input, weight, ...) reads `input` without copying it: flame.channels_last
    where the forward - and, when weight requires grad under grad mode, the weight gradient - runs the
    implicit-GEMM kernels on a channel count that is a multiple of 8 (their operand is NHWC; a channels-last input
    is one already), else flame.contiguous_format. Whoever makes the input can write it so in the same pass
    (F.group_norm_silu(..., memory_format=...)): no transpose then sits between the two."""
    from .. import autograd
    if input.ndim != 4 or not isinstance(padding, (int, tuple, list)):
        return MF.contiguous_format
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, padding, dilation, int(groups))
    x = input._data
    train_w = weight.requires_grad and autograd.is_grad_enabled()
    if g.C % 8 or input.dtype != weight.dtype or not use_igemm(x, g) or (train_w and not use_igemm(x, g, "dw")):
        return MF.contiguous_format
    return MF.channels_last
