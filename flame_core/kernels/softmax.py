"""Softmax / log-softmax of `scale * x` over the last axis, on arrays (kernel: cuda_src/softmax.cu).

`softmax_forward(x, scale=1.0, log=False)` -> y of x's dtype; `softmax_backward(dy, y, scale=1.0, log=False)` -> dx
(the gradient with respect to x, so it includes `scale`). float16 / bfloat16 compute in float32.
"""
from . import loader as L


def _rows(a):
    cols = a.shape[-1] if a.ndim else 1
    return (a.size // cols if cols else 0), cols


# ----------------------------------------------------------------------------- references
def _forward_ref(x, scale, log):
    xp = L.xp_of(x)
    z = x.astype(L.compute_dtype(x.dtype)) * scale
    z = z - z.max(axis=-1, keepdims=True)
    if log:
        y = z - xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    else:
        e = xp.exp(z)
        y = e / e.sum(axis=-1, keepdims=True)
    return y.astype(x.dtype)


def _backward_ref(dy, y, scale, log):
    xp = L.xp_of(y)
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
    x = L.contiguous(x)
    y = L.xp_of(x).empty_like(x)
    rows, cols = _rows(x)
    vec = L.vec_width(x.dtype)
    kernel, grid, block, tpr = L.row_plan("softmax", "softmax_fwd", x.dtype, rows, cols, vec if cols % vec == 0 else 1)
    L.launch(kernel, grid, block,
             (x, y, L.i64(rows), L.i32(cols), L.f32(scale), L.i32(bool(log)), L.i32(tpr)))
    return y


def softmax_backward(dy, y, scale=1.0, log=False):
    if dy.shape != y.shape:
        raise ValueError(f"softmax_backward: gradient shape {dy.shape} differs from output shape {y.shape}")
    if not (L.use_kernel(y) and y.size):
        return _backward_ref(dy, y, scale, log)
    y, dy = L.contiguous(y), L.contiguous(dy.astype(y.dtype, copy=False))
    dx = L.xp_of(y).empty_like(y)
    rows, cols = _rows(y)
    vec = L.vec_width(y.dtype)
    kernel, grid, block, tpr = L.row_plan("softmax", "softmax_bwd", y.dtype, rows, cols, vec if cols % vec == 0 else 1)
    L.launch(kernel, grid, block,
             (dy, y, dx, L.i64(rows), L.i32(cols), L.f32(scale), L.i32(bool(log)), L.i32(tpr)))
    return dx
