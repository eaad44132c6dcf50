"""Softmax / log-softmax of `scale * x` over the last axis, on arrays (kernel: cuda_src/softmax.cu).

`softmax_forward(x, scale=1.0, log=False)` -> y of x's dtype; `softmax_backward(dy, y, scale=1.0, log=False)` -> dx
(the gradient with respect to x, so it includes `scale`). float16 / bfloat16 compute in float32.
"""
from .. import backend
from . import launching as KL
from . import loader as L
from . import plans as P


def _rows(a):
    cols = a.shape[-1] if a.ndim else 1
    return (a.size // cols if cols else 0), cols


# ----------------------------------------------------------------------------- references
def _forward_ref(x, scale, log):
    xp = backend.xp_of(x)
    z = x.astype(L.compute_dtype(x.dtype)) * scale
    z = z - z.max(axis=-1, keepdims=True)
    if log:
        y = z - xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    else:
        e = xp.exp(z)
        y = e / e.sum(axis=-1, keepdims=True)
    return y.astype(x.dtype)


def _backward_ref(dy, y, scale, log):
    xp = backend.xp_of(y)
    cd = L.compute_dtype(y.dtype)
    g, yf = dy.astype(cd), y.astype(cd)
    if log:
        dx = scale * (g - xp.exp(yf) * g.sum(axis=-1, keepdims=True))
    else:
        dx = scale * yf * (g - (g * yf).sum(axis=-1, keepdims=True))
    return dx.astype(y.dtype)


# ----------------------------------------------------------------------------- API
def softmax_forward(x, scale=1.0, log=False):
    if x.ndim == 0:
        raise ValueError("softmax_forward: needs at least one axis (got a 0-d array)")
    if not (L.use_kernel(x) and x.size):
        return _forward_ref(x, scale, log)
    x = P.contiguous(x)
    y = backend.xp_of(x).empty_like(x)
    rows, cols = _rows(x)
    vec = P.vec_width(x.dtype)
    kernel, grid, block, tpr = P.row_plan("softmax", "softmax_fwd", x.dtype, rows, cols, vec if cols % vec == 0 else 1)
    KL.launch(kernel, grid, block,
              (x, y, KL.i64(rows), KL.i32(cols), KL.f32(scale), KL.i32(bool(log)), KL.i32(tpr)))
    return y


def softmax_backward(dy, y, scale=1.0, log=False):
    if dy.shape != y.shape:
        raise ValueError(f"softmax_backward: gradient shape {dy.shape} differs from output shape {y.shape}")
    if not (L.use_kernel(y) and y.size):
        return _backward_ref(dy, y, scale, log)
    y, dy = P.contiguous(y), P.contiguous(dy.astype(y.dtype, copy=False))
    dx = backend.xp_of(y).empty_like(y)
    rows, cols = _rows(y)
    vec = P.vec_width(y.dtype)
    kernel, grid, block, tpr = P.row_plan("softmax", "softmax_bwd", y.dtype, rows, cols, vec if cols % vec == 0 else 1)
    KL.launch(kernel, grid, block,
              (dy, y, dx, KL.i64(rows), KL.i32(cols), KL.f32(scale), KL.i32(bool(log)), KL.i32(tpr)))
    return dx
