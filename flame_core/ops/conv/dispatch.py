"""conv2d on arrays: each pass sent to its path (routing.py) - the implicit GEMM, a plain 1x1's GEMMs or im2col +
GEMM - and the bias gradients."""
import numpy as np

from ... import backend
from .im2col_gemm import im2col_backward, im2col_forward
from .implicit_gemm import igemm_backward, igemm_forward, reads_in_place
from .phases import strided_dx
from .planning import HALF, is_pointwise
from .pointwise import pointwise_backward, pointwise_forward
from .routing import use_igemm, use_wgmma


def conv2d_forward(x, w, g, bias=None, emb=None, res=None):
    """y (N, O, OH, OW) = conv2d(x, w) (+ bias (O,)) (+ emb (N, O) over every pixel) (+ res, y's shape), on arrays.
    The wgmma kernel adds emb and res in its epilogue; the other paths add them to the fresh output after."""
    xp = backend.xp_of(x)
    ig = use_igemm(x, g)
    if not (ig and reads_in_place(x, g.C)):  # the implicit GEMM reads a channels-last x as its NHWC operand
        x = xp.ascontiguousarray(x)
    w = xp.ascontiguousarray(w)
    c = (lambda a: None if a is None else xp.ascontiguousarray(a))
    if ig:
        if use_wgmma(x, g):
            return igemm_forward(x, w, g, c(bias), c(emb), c(res), wgmma=True)
        y = igemm_forward(x, w, g, c(bias), wgmma=False)
    else:
        y = pointwise_forward(x, w, g) if is_pointwise(g) and g.G == 1 else im2col_forward(x, w, g)
        if bias is not None:
            y += bias.reshape(1, -1, 1, 1)
    if emb is not None:
        y += emb.reshape(g.N, g.O, 1, 1)
    if res is not None:
        y += res
    return y


def conv2d_backward(gy, x, w, g, need_x=True, need_w=True):
    """(dx, dw) of conv2d for output gradient gy (either may be None when not needed), on arrays."""
    if not (need_x or need_w):
        return None, None
    xp = backend.xp_of(x)
    w = xp.ascontiguousarray(w)
    if is_pointwise(g) and g.G == 1:
        return pointwise_backward(xp.ascontiguousarray(gy), xp.ascontiguousarray(x), w, g, need_x, need_w)
    # the transposed conv is a conv at stride 1, and one conv per phase of dx when strided (dilation 1)
    ig_x = need_x and (g.sh == g.sw == 1 or strided_dx(g)) and use_igemm(x, g, "dx")
    ig_w = need_w and use_igemm(x, g, "dw")
    dx = dw = None
    if ig_x or ig_w:  # channels-last x / dy are read in place as the kernels' NHWC operands
        dx, dw = igemm_backward(gy if reads_in_place(gy, g.O) else xp.ascontiguousarray(gy),
                                x if not ig_w or reads_in_place(x, g.C) else xp.ascontiguousarray(x), w, g, ig_x,
                                ig_w)
    if (need_x and not ig_x) or (need_w and not ig_w):
        dx2, dw2 = im2col_backward(xp.ascontiguousarray(gy), xp.ascontiguousarray(x), w, g, need_x and not ig_x,
                                   need_w and not ig_w)
        dx = dx2 if dx is None else dx
        dw = dw2 if dw is None else dw
    return dx, dw


def bias_grad(gy):
    """Sum of gy over (N, OH, OW), accumulated in float32 for half types."""
    if gy.dtype in HALF:
        return gy.sum(axis=(0, 2, 3), dtype=np.float32).astype(gy.dtype)
    return gy.sum(axis=(0, 2, 3))


def image_bias_grad(gy):
    """Sum of gy over (OH, OW) per image and channel (N, O), accumulated in float32 for half types."""
    if gy.dtype in HALF:
        return gy.sum(axis=(2, 3), dtype=np.float32).astype(gy.dtype)
    return gy.sum(axis=(2, 3))
