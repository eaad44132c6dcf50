"""A plain 1x1 convolution (stride 1, no padding): GEMMs on the input itself, no column matrix."""
import numpy as np

from ... import backend
from ...kernels import gemm as _gemm
from .matmul import mm
from .planning import HALF


def pointwise_forward(x, w, g):
    """A plain 1x1 conv: y[n] (O, H*W) = W (O, C) @ x[n] (C, H*W), one GEMM batched over the images (the weight
    broadcast), no copies."""
    y = backend.xp_of(x).empty((g.N, g.O, g.OH, g.OW), dtype=x.dtype)
    mm(w.reshape(g.O, g.C), x.reshape(g.N, g.C, g.H * g.W), y.reshape(g.N, g.O, g.H * g.W))
    return y


# a 1x1 weight gradient of at least this many per-image products (N * O * C) accumulates image by image into one
# float32 sum: measured on an H200 (95187a4), 2x2560x32^2 -> 1280: 0.067 -> 0.054 ms, 2x960x128^2 -> 320: 0.064 ->
# 0.056, but 2x320x64^2 -> 640 (409,600 products): 0.021 -> 0.025 - there the batched GEMM's parallelism wins
POINTWISE_DW_ACC_MIN = 1 << 19


def pointwise_backward(gy, x, w, g, need_x, need_w):
    """(dx, dw) of a plain 1x1 conv: dx[n] = W^T @ dy[n] (one batched GEMM); dw = sum_n dy[n] @ x[n]^T (one GEMM for
    a single image; on a GPU in half precision, from POINTWISE_DW_ACC_MIN products on, one GEMM per image
    accumulating into one float32 sum, rounded once; else one batched GEMM whose per-image products are summed in
    float32)."""
    xp = backend.xp_of(x)
    gy3 = gy.reshape(g.N, g.O, g.H * g.W)
    dx = dw = None
    if need_x:
        dx = xp.empty(x.shape, dtype=x.dtype)
        mm(w.reshape(g.O, g.C).T, gy3, dx.reshape(g.N, g.C, g.H * g.W))
    if need_w:
        x3 = x.reshape(g.N, g.C, g.H * g.W)
        if g.N == 1:
            dw = mm(gy3[0], x3[0].T)
        elif (xp is not np and w.dtype in HALF and _gemm.supported(w.dtype)
              and g.N * g.O * g.C >= POINTWISE_DW_ACC_MIN):
            # one GEMM per image into one float32 accumulator (beta = 1): no per-image products rounded and summed
            acc = xp.empty((g.O, g.C), dtype=np.float32)
            for n in range(g.N):
                _gemm.matmul(gy3[n], x3[n].T, out=acc, beta=0.0 if n == 0 else 1.0)
            dw = acc.astype(w.dtype)
        else:
            acc = np.float32 if w.dtype in HALF else w.dtype
            dw = mm(gy3, x3.transpose(0, 2, 1)).sum(axis=0, dtype=acc).astype(w.dtype, copy=False)
        dw = dw.reshape(w.shape)
    return dx, dw
