"""The residual add fused with the norm after it, one kernel each way (kernels: cuda_src/add_layer_norm.cu): a
pre-norm transformer's `x = x + f(...)` and the next `layer_norm(x)` in one pass.

    add_layer_norm_forward(x, r, w, b, eps, rms)  -> s = x + r, y = norm(s) w + b, mean (None when rms), rstd
    add_layer_norm_backward(dy, ds, s, w, mean, rstd, rms, weight_grad, bias_grad) -> dsum, dw, db

x, r: (..., D) of one shape and dtype; w, b: (D,) (x's dtype or float32) or None (rms: no bias); mean, rstd: the
rows' statistics ((...,) compute dtype). s and y are x's dtype: y normalises s AS ROUNDED to that dtype, so it equals
layer_norm(x + r) computed by the two ops up to the reduction order. dsum = d(s) + ds is the gradient of x and of r
alike (ds: s's own gradient, or None). Statistics in fp32 (float64 for float64).
"""
import numpy as np

from .. import backend
from ..errors import ShapeError, fmt_shape
from . import launching as KL
from . import loader as L
from . import plans as P
from .norms import _layer_ref, _packed_ptrs, _param_args

MAX_D = 4096  # the kernels cache 16 values of a row per thread, 256 threads per row at most
BLOCK = 256


def _check(x, r, weight, bias):
    if x.shape != r.shape or x.dtype != r.dtype:
        raise ShapeError(f"add_layer_norm: x {fmt_shape(x.shape)} {x.dtype} and residual {fmt_shape(r.shape)} "
                         f"{r.dtype} must have one shape and dtype")
    if x.ndim == 0:
        raise ShapeError("add_layer_norm: x must have at least one dim, got a scalar")
    for p, what in ((weight, "weight"), (bias, "bias")):
        if p is not None and tuple(p.shape) != x.shape[-1:]:
            raise ShapeError(f"add_layer_norm: {what} has shape {fmt_shape(p.shape)}, expected ({x.shape[-1]},) "
                             f"for x {fmt_shape(x.shape)}")


# ----------------------------------------------------------------------------- references
def _forward_ref(x, r, weight, bias, eps, rms):
    s = x + r  # rounded to x's dtype, as the add op stores it
    y, mean, rstd = _layer_ref(s, weight, bias, eps, rms)
    return s, y, mean, rstd


def _backward_ref(dy, ds, s, weight, mean, rstd, rms, weight_grad, bias_grad):
    cd = L.compute_dtype(s.dtype)
    g = dy.astype(cd) * weight.astype(cd) if weight is not None else dy.astype(cd)
    sf, rs = s.astype(cd), rstd.astype(cd)[..., None]
    xh = (sf if rms else sf - mean.astype(cd)[..., None]) * rs
    dot = (g * xh).mean(axis=-1, keepdims=True)
    dx = rs * (g - xh * dot) if rms else rs * (g - g.mean(axis=-1, keepdims=True) - xh * dot)
    if ds is not None:
        dx = dx + ds.astype(cd)  # added before the rounding, as the kernel does
    return (dx.astype(s.dtype),) + _param_grads(dy, s, mean, rstd, rms, weight, weight_grad, bias_grad)


# ----------------------------------------------------------------------------- kernels
def _plan(D, dtype, arrays):
    """(G, vec): G threads per row, 16-byte vectors or not; None when D is past MAX_D or empty."""
    if D > MAX_D or D == 0:
        return None
    n = P.vec_width(dtype)
    vec = D % n == 0 and all(a is None or a.data.ptr % 16 == 0 for a in arrays)
    per = n if vec else 1
    G = 1
    while G < BLOCK and G * per < D:  # the most threads per row (one vector each) up to a block
        G *= 2
    if G * 16 < D:
        return None
    return G, int(vec)


def _grid(rows, G):
    """Rows of <= 32 threads: BLOCK threads, several rows per block; wider rows: one row per block of G threads."""
    rpb, block = (BLOCK // G, BLOCK) if G <= 32 else (1, G)
    return (max(1, min(P.cdiv(rows, rpb), P.sm_count() * 16)),), (block,)


def _ptr(a):
    return KL.null() if a is None else a


_FWD = KL.LaunchCache()   # (shape, dtype, params present, eps, rms, stats) -> (launch, stats shape)
_nd = backend._cupy_ndarray   # cupy.ndarray, or () without CuPy (no array's type)


def _forward_cached(x, r, weight, bias, eps, rms, stats):
    """The eager per-op path of the forward: x, r, weight, bias as norms._packed_ptrs takes them (weight / bias may be
    None). The launch of this configuration is packed once; a call allocates the outputs, writes eight
    addresses and launches. None when the arrays are not of that form (the general path runs)."""
    ptrs = _packed_ptrs((x, r), (weight, bias))   # misaligned arrays: the general path copies them (the same sums)
    if ptrs is None:
        return None
    px, pr, pw, pb = ptrs
    nd, dt, shape = _nd, x.dtype, x.shape
    key = (shape, dt, pw == 0, pb == 0, eps, rms, stats)
    entry = _FWD.get(key)
    if entry is None:
        D = shape[-1]
        rows = x.size // D
        plan = _plan(D, dt, [x, r] + [p for p in (weight, bias) if p is not None])
        if plan is None:
            return None
        G, vec = plan
        grid, block = _grid(rows, G)
        pl = KL.PackedLaunch(L.get_function("add_layer_norm", "add_layer_norm_fwd", dt), grid, block,
                             (None,) * 8 + (KL.i64(rows), KL.i32(D), KL.i32(G), KL.f32(eps), KL.i32(0),
                                            KL.i32(int(rms)), KL.i32(vec)), 8)
        entry = _FWD.put(key, (pl, shape[:-1]))
    pl, sshape = entry
    s, y = nd(shape, dt), nd(shape, dt)
    rstd = nd(sshape, np.float32) if stats else None
    mean = nd(sshape, np.float32) if stats and not rms else None
    pl((px, pr, s.data.ptr, y.data.ptr, 0 if mean is None else mean.data.ptr, 0 if rstd is None else rstd.data.ptr,
        pw, pb))
    return s, y, mean, rstd


def _forward_kernel(x, r, weight, bias, eps, rms, stats=True):
    out = _forward_cached(x, r, weight, bias, eps, rms, stats)
    if out is not None:
        return out
    xp = backend.xp_of(x)
    D = x.shape[-1]
    rows = x.size // D
    x2, r2 = P.contiguous(x).reshape(rows, D), P.contiguous(r).reshape(rows, D)
    (w, b), wf32 = _param_args(x, weight, bias)   # pointers (null where absent), both in x's dtype or fp32
    plan = _plan(D, x.dtype, [x2, r2] + [a for a, p in ((w, weight), (b, bias)) if p is not None])
    if plan is None:
        return None
    G, vec = plan
    s, y = xp.empty(x.shape, x.dtype), xp.empty(x.shape, x.dtype)
    rstd = xp.empty(x.shape[:-1], np.float32) if stats else None   # no backward: the statistics are not kept
    mean = None if rms or not stats else xp.empty(x.shape[:-1], np.float32)
    grid, block = _grid(rows, G)
    KL.launch(L.get_function("add_layer_norm", "add_layer_norm_fwd", x.dtype), grid, block,
              (x2, r2, s, y, _ptr(mean), _ptr(rstd), w, b, KL.i64(rows), KL.i32(D), KL.i32(G), KL.f32(eps),
               KL.i32(wf32), KL.i32(int(rms)), KL.i32(vec)))
    return s, y, mean, rstd


def _backward_kernel(dy, ds, s, weight, mean, rstd, rms):
    xp = backend.xp_of(s)
    D = s.shape[-1]
    rows = s.size // D
    dy2 = P.contiguous(dy.astype(s.dtype, copy=False)).reshape(rows, D)
    ds2 = None if ds is None else P.contiguous(ds.astype(s.dtype, copy=False)).reshape(rows, D)
    s2 = P.contiguous(s).reshape(rows, D)
    (w,), wf32 = _param_args(s, weight)
    plan = _plan(D, s.dtype, [dy2, ds2, s2] + ([w] if weight is not None else []))
    if plan is None:
        return None
    G, vec = plan
    dsum = xp.empty(s.shape, s.dtype)
    grid, block = _grid(rows, G)
    KL.launch(L.get_function("add_layer_norm", "add_layer_norm_bwd", s.dtype), grid, block,
              (dy2, s2, _ptr(None if rms else P.contiguous(mean.astype(np.float32, copy=False))),
               P.contiguous(rstd.astype(np.float32, copy=False)), _ptr(ds2), dsum, w, KL.i64(rows), KL.i32(D),
               KL.i32(G), KL.i32(wf32), KL.i32(vec)))
    return dsum


def _param_grads(dy, s, mean, rstd, rms, weight, weight_grad, bias_grad):
    """dw = sum over rows of dy xhat, db = sum of dy (array ops: only trained norms need them)."""
    cd = L.compute_dtype(s.dtype)
    red = tuple(range(s.ndim - 1))
    g0 = dy.astype(cd)
    dw = db = None
    if weight_grad:
        sf = s.astype(cd)
        xh = (sf if rms else sf - mean.astype(cd)[..., None]) * rstd.astype(cd)[..., None]
        dw = (g0 * xh).sum(axis=red).astype(weight.dtype)
    if bias_grad:
        db = g0.sum(axis=red)
    return dw, db


# ----------------------------------------------------------------------------- API
def add_layer_norm_forward(x, r, weight=None, bias=None, eps=1e-5, rms=False, stats=True):
    """-> (s, y, mean or None, rstd or None); stats=False (no backward to come): the kernel keeps neither statistic
    (two allocations fewer per call on the eager inference path)."""
    _check(x, r, weight, bias)
    if rms and bias is not None:
        raise ValueError("add_rms_norm: no bias (RMSNorm has a gain only)")
    if L.use_kernel(x, r, weight, bias) and x.size:
        out = _forward_kernel(x, r, weight, bias, eps, rms, stats)
        if out is not None:
            return out
    out = _forward_ref(x, r, weight, bias, eps, rms)
    return out if stats else out[:2] + (None, None)


def add_layer_norm_backward(dy, ds, s, weight, mean, rstd, rms=False, weight_grad=False, bias_grad=False):
    """-> (dsum, dw or None, db or None); db comes in the compute dtype (the caller casts it to the bias')."""
    if tuple(dy.shape) != tuple(s.shape) or (ds is not None and tuple(ds.shape) != tuple(s.shape)):
        raise ShapeError(f"add_layer_norm backward: gradients {fmt_shape(dy.shape)} and "
                         f"{None if ds is None else fmt_shape(ds.shape)}, expected {fmt_shape(s.shape)}")
    weight_grad = weight_grad and weight is not None
    if L.use_kernel(dy, ds, s, weight) and s.size:
        dsum = _backward_kernel(dy, ds, s, weight, mean, rstd, rms)
        if dsum is not None:
            return (dsum,) + _param_grads(dy, s, mean, rstd, rms, weight, weight_grad, bias_grad)
    return _backward_ref(dy, ds, s, weight, mean, rstd, rms, weight_grad, bias_grad)
