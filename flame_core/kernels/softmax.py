"""Softmax / log-softmax of `scale * x` over the last axis, on arrays (kernel: cuda_src/softmax.cu).

`softmax_forward(x, scale=1.0, log=False)` -> y of x's dtype; `softmax_backward(dy, y, scale=1.0, log=False)` -> dx
(the gradient with respect to x, so it includes `scale`). float16 / bfloat16 compute in float32.
"""
import threading

from .. import backend
from ..memory import recycle
from . import launching as KL
from . import loader as L
from . import plans as P

_local = threading.local()   # .launches: {(kernel name, dtype, rows, cols, scale, log, device): PackedLaunch}
_nd = backend._cupy_ndarray if backend.cupy is not None else None
_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None


def _rows(a):
    cols = a.shape[-1] if a.ndim else 1
    return (a.size // cols if cols else 0), cols


# ----------------------------------------------------------------------------- references
def _forward_ref(x, scale, log):
    """In place on one working copy (the CPU path's per-op cost: five passes, no temporaries but the row sums)."""
    xp = backend.xp_of(x)
    if not x.size:   # no rows or empty rows: an empty result (the row max has no identity)
        return x.copy()
    z = x.astype(L.compute_dtype(x.dtype))   # a copy, written in place below
    if scale != 1.0:
        z *= scale
    z -= z.max(axis=-1, keepdims=True)
    if log:
        z -= xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    else:
        xp.exp(z, out=z)
        z /= z.sum(axis=-1, keepdims=True)
    return z if z.dtype == x.dtype else z.astype(x.dtype)


def _backward_ref(dy, y, scale, log):
    xp = backend.xp_of(y)
    if not y.size:
        return y.copy()
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
    y = _new(x)
    rows, cols = _rows(x)
    _packed("softmax_fwd", x.dtype, rows, cols, scale, log, 2)((x.data.ptr, y.data.ptr))
    return y


def _new(a):
    """An output of a's shape and dtype (from the bin of small dead arrays when it holds one)."""
    out = recycle.take(a.shape, a.dtype) if recycle.on[0] and a.size <= recycle.MAX_NUMEL else None
    return _nd(a.shape, a.dtype) if out is None else out


def _packed(name, dtype, rows, cols, scale, log, n_arrays):
    """This thread's packed launch of the row kernel `name` for one (dtype, rows, cols, scale, log, device): the plan
    (cuda_src/softmax.cu's kernel variant, grid, block, threads per row) and the scalar arguments made once; a call
    writes only the array addresses (the per-op host cost of an eager softmax)."""
    key = (name, dtype, rows, cols, scale, bool(log), _get_device(), P.vpt_override)
    try:
        cache = _local.launches
    except AttributeError:
        cache = _local.launches = {}
    pl = cache.get(key)
    if pl is None:
        vec = P.vec_width(dtype)
        kernel, grid, block, tpr = P.row_plan("softmax", name, dtype, rows, cols, vec if cols % vec == 0 else 1)
        if len(cache) >= 256:
            cache.clear()
        pl = cache[key] = KL.PackedLaunch(kernel, grid, block, (None,) * n_arrays + (
            KL.i64(rows), KL.i32(cols), KL.f32(scale), KL.i32(bool(log)), KL.i32(tpr)), n_arrays)
    return pl


def softmax_backward(dy, y, scale=1.0, log=False):
    if dy.shape != y.shape:
        raise ValueError(f"softmax_backward: gradient shape {dy.shape} differs from output shape {y.shape}")
    if not (L.use_kernel(y) and y.size):
        return _backward_ref(dy, y, scale, log)
    y, dy = P.contiguous(y), P.contiguous(dy.astype(y.dtype, copy=False))
    dx = _new(y)
    rows, cols = _rows(y)
    _packed("softmax_bwd", y.dtype, rows, cols, scale, log, 3)((dy.data.ptr, y.data.ptr, dx.data.ptr))
    return dx
