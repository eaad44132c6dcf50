"""adaLN modulation and gated residual on arrays (kernel: cuda_src/modulate.cu).

x is (B, L, H) (any middle dims are flattened into L; a 2-D (B, H) x has L = 1); the modulation vectors shift /
scale / gate have shape (B, 1, H), (B, H), (1, H) or (H,) and broadcast over L:

    modulate_forward(x, shift, scale)          -> x * (1 + scale) + shift
    modulate_backward(dy, x, shift, scale)     -> (dx, dshift, dscale)     (dshift / dscale shaped like the inputs)
    gated_residual_forward(x, gate, y)         -> x + gate * y
    gated_residual_backward(dout, gate, y)     -> (dx, dgate, dy)          (dx is dout itself)
    broadcast_scale(g, coef, off)              -> g * (coef + off)         (the input gradient alone, for a frozen
                                                                            modulation vector: off 1 for modulate's
                                                                            x, 0 for gated_residual's y)
"""
import numpy as np

from .. import backend
from ..errors import ShapeError
from . import column_sum as CS
from . import launching as KL
from . import loader as L
from . import plans as P


def _bld(x, name):
    if x.ndim < 2:
        raise ShapeError(f"{name}: x must be (B, L, H) or (B, H), got shape {tuple(x.shape)}")
    b, h = x.shape[0], x.shape[-1]
    return b, (x.size // (b * h) if b * h else 0), h


def _as_bh(m, b, h, name, what):
    """The modulation vector as (B, H) (broadcast over B when it has no batch axis)."""
    xp = backend.xp_of(m)
    shape = tuple(m.shape)
    ok = (m.ndim >= 1 and shape[-1] == h and all(s == 1 for s in shape[1:-1] if m.ndim > 2)
          and (m.ndim == 1 or shape[0] in (1, b)))
    if not ok:
        raise ShapeError(f"{name}: {what} of shape {shape} does not broadcast as (B, 1, H) over x with B={b}, H={h}")
    m2 = m.reshape(-1, h)
    return m2 if m2.shape[0] == b else xp.broadcast_to(m2, (b, h))


def _sum_to(g, shape):
    """Sum a (B, H) gradient to the modulation vector's own shape."""
    if g.shape[0] != 1 and (len(shape) == 1 or shape[0] == 1):
        g = g.sum(axis=0, keepdims=True)
    return g.reshape(shape)


def _mod_args(x, *mods):
    if all(m.dtype == x.dtype for m in mods):
        return [P.contiguous(m) for m in mods], 0
    return [P.contiguous(m.astype(np.float32)) for m in mods], 1


# ----------------------------------------------------------------------------- references
def _modulate_ref(x, shift, scale):
    b, l, h = _bld(x, "modulate")
    cd = L.compute_dtype(x.dtype)
    sh = _as_bh(shift, b, h, "modulate", "shift").astype(cd, copy=False)[:, None]
    sc = _as_bh(scale, b, h, "modulate", "scale").astype(cd, copy=False)[:, None]
    y = x.astype(cd, copy=False).reshape(b, l, h) * (1 + sc) + sh
    return y.reshape(x.shape).astype(x.dtype, copy=False)


def _modulate_grad_ref(dy, x, shift, scale):
    b, l, h = _bld(x, "modulate")
    cd = L.compute_dtype(x.dtype)
    sc = _as_bh(scale, b, h, "modulate", "scale").astype(cd, copy=False)[:, None]
    g, xf = dy.astype(cd, copy=False).reshape(b, l, h), x.astype(cd, copy=False).reshape(b, l, h)
    dx = (g * (1 + sc)).reshape(x.shape).astype(x.dtype, copy=False)
    dshift = _sum_to(g.sum(axis=1), shift.shape).astype(shift.dtype, copy=False)
    dscale = _sum_to((g * xf).sum(axis=1), scale.shape).astype(scale.dtype, copy=False)
    return dx, dshift, dscale


def _gated_ref(x, gate, y):
    b, l, h = _bld(x, "gated_residual")
    cd = L.compute_dtype(x.dtype)
    gt = _as_bh(gate, b, h, "gated_residual", "gate").astype(cd, copy=False)[:, None]
    out = x.astype(cd, copy=False).reshape(b, l, h) + gt * y.astype(cd, copy=False).reshape(b, l, h)
    return out.reshape(x.shape).astype(x.dtype, copy=False)


def _gated_grad_ref(dout, gate, y):
    b, l, h = _bld(y, "gated_residual")
    cd = L.compute_dtype(y.dtype)
    gt = _as_bh(gate, b, h, "gated_residual", "gate").astype(cd, copy=False)[:, None]
    g = dout.astype(cd, copy=False).reshape(b, l, h)
    dy = (g * gt).reshape(y.shape).astype(y.dtype, copy=False)
    dgate = _sum_to((g * y.astype(cd, copy=False).reshape(b, l, h)).sum(axis=1), gate.shape)
    dgate = dgate.astype(gate.dtype, copy=False)
    return dout, dgate, dy


def _bscale_ref(g, coef, off):
    b, l, h = _bld(g, "broadcast_scale")
    cd = L.compute_dtype(g.dtype)
    c = _as_bh(coef, b, h, "broadcast_scale", "coef").astype(cd, copy=False)[:, None]
    return (g.astype(cd, copy=False).reshape(b, l, h) * (c + off)).reshape(g.shape).astype(g.dtype, copy=False)


# ----------------------------------------------------------------------------- kernels
def _fwd_grid(b, lh, dtype):
    block = 256
    gx = max(1, min(P.cdiv(P.cdiv(lh, P.vec_width(dtype)), block), max(1, P.sm_count() * 16 // b)))
    return (gx, b), (block,)


single_launch_sums = True  # the modulation gradients summed inside bcast_bwd (False: a mod_column_sum launch each)


def _bwd_launch(dout, a, coef, off, want_da, want_sum, mf32, b, l, h, out_dtypes):
    """bcast_bwd: (da, dcoef, dsum) with dcoef / dsum (B, H) in out_dtypes (dsum None unless want_sum)."""
    xp = backend.xp_of(a)
    vec = P.vec_width(a.dtype)
    use_vec = h % vec == 0
    cols_per_block = 32 * (vec if use_vec else 1)
    gx = P.cdiv(h, cols_per_block)
    splits = max(1, min(P.cdiv(P.sm_count() * 4, gx * b), P.cdiv(l, 8)))
    da = xp.empty_like(a) if want_da else None
    dcoef_part = xp.empty((b, splits, h), dtype=np.float32)
    dsum_part = xp.empty((b, splits, h), dtype=np.float32) if want_sum else None
    args = (dout, a, coef, KL.f32(off), KL.null() if da is None else da, dcoef_part,
            KL.null() if dsum_part is None else dsum_part, KL.i32(l), KL.i32(h), KL.i32(mf32), KL.i32(use_vec))
    kernel = L.get_function("modulate", "bcast_bwd", a.dtype)
    if not single_launch_sums:
        KL.launch(kernel, (gx, b, splits), (32, 8), args + (KL.null(), KL.null(), KL.null(), KL.i32(0)))
        dcoef = CS.column_sum("modulate", "mod_column_sum", dcoef_part, out_dtypes[0])
        dsum = CS.column_sum("modulate", "mod_column_sum", dsum_part, out_dtypes[1]) if want_sum else None
        return da, dcoef, dsum
    # the last block of each (column chunk, batch) sums the chunk's split rows: outputs in a's dtype, else fp32
    odt = a.dtype if all(d is None or d == a.dtype for d in out_dtypes) else np.dtype(np.float32)
    dcoef = xp.empty((b, h), dtype=odt)
    dsum = xp.empty((b, h), dtype=odt) if want_sum else None
    KL.launch(kernel, (gx, b, splits), (32, 8),
              args + (dcoef, KL.null() if dsum is None else dsum, CS.reduction_counters(gx * b),
                      KL.i32(odt != a.dtype)))
    dcoef = dcoef.astype(out_dtypes[0], copy=False)
    dsum = dsum.astype(out_dtypes[1], copy=False) if want_sum else None
    return da, dcoef, dsum


def _modulate_kernel(x, shift, scale):
    b, l, h = _bld(x, "modulate")
    x = P.contiguous(x)
    (sh, sc), mf32 = _mod_args(x, _as_bh(shift, b, h, "modulate", "shift"), _as_bh(scale, b, h, "modulate", "scale"))
    y = backend.xp_of(x).empty_like(x)
    grid, block = _fwd_grid(b, l * h, x.dtype)
    KL.launch(L.get_function("modulate", "modulate_fwd", x.dtype), grid, block,
              (x, sh, sc, y, KL.i64(l * h), KL.i32(h), KL.i32(mf32)))
    return y


def _modulate_grad_kernel(dy, x, shift, scale):
    b, l, h = _bld(x, "modulate")
    x, dy = P.contiguous(x), P.contiguous(dy.astype(x.dtype, copy=False))
    (sc,), mf32 = _mod_args(x, _as_bh(scale, b, h, "modulate", "scale"))
    dx, dscale, dshift = _bwd_launch(dy, x, sc, 1.0, True, True, mf32, b, l, h, (scale.dtype, shift.dtype))
    return dx, _sum_to(dshift, shift.shape), _sum_to(dscale, scale.shape)


def _gated_kernel(x, gate, y):
    b, l, h = _bld(x, "gated_residual")
    x, y = P.contiguous(x), P.contiguous(y.astype(x.dtype, copy=False))
    (gt,), mf32 = _mod_args(x, _as_bh(gate, b, h, "gated_residual", "gate"))
    out = backend.xp_of(x).empty_like(x)
    grid, block = _fwd_grid(b, l * h, x.dtype)
    KL.launch(L.get_function("modulate", "gated_fwd", x.dtype), grid, block,
              (x, gt, y, out, KL.i64(l * h), KL.i32(h), KL.i32(mf32)))
    return out


def _gated_grad_kernel(dout, gate, y):
    b, l, h = _bld(y, "gated_residual")
    y, g = P.contiguous(y), P.contiguous(dout.astype(y.dtype, copy=False))
    (gt,), mf32 = _mod_args(y, _as_bh(gate, b, h, "gated_residual", "gate"))
    dy, dgate, _ = _bwd_launch(g, y, gt, 0.0, True, False, mf32, b, l, h, (gate.dtype, None))
    return dout, _sum_to(dgate, gate.shape), dy


def _bscale_kernel(g, coef, off):
    b, l, h = _bld(g, "broadcast_scale")
    g = P.contiguous(g)
    (cf,), mf32 = _mod_args(g, _as_bh(coef, b, h, "broadcast_scale", "coef"))
    out = backend.xp_of(g).empty_like(g)
    grid, block = _fwd_grid(b, l * h, g.dtype)
    KL.launch(L.get_function("modulate", "bcast_scale", g.dtype), grid, block,
              (g, cf, out, KL.i64(l * h), KL.i32(h), KL.i32(mf32), KL.f32(off)))
    return out


def _check_same(name, a, b, what):
    if a.shape != b.shape:
        raise ShapeError(f"{name}: {what} shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")


# ----------------------------------------------------------------------------- API
def modulate_forward(x, shift, scale):
    if L.use_kernel(x) and x.size:
        return _modulate_kernel(x, shift, scale)
    return _modulate_ref(x, shift, scale)


def modulate_backward(dy, x, shift, scale):
    _check_same("modulate_backward", dy, x, "gradient and input")
    if L.use_kernel(x) and x.size:
        return _modulate_grad_kernel(dy, x, shift, scale)
    return _modulate_grad_ref(dy, x, shift, scale)


def gated_residual_forward(x, gate, y):
    _check_same("gated_residual", x, y, "x and y")
    if L.use_kernel(x) and x.size:
        return _gated_kernel(x, gate, y)
    return _gated_ref(x, gate, y)


def gated_residual_backward(dout, gate, y):
    _check_same("gated_residual_backward", dout, y, "gradient and y")
    if L.use_kernel(y) and y.size:
        return _gated_grad_kernel(dout, gate, y)
    return _gated_grad_ref(dout, gate, y)


def broadcast_scale(g, coef, off):
    if L.use_kernel(g) and g.size:
        return _bscale_kernel(g, coef, off)
    return _bscale_ref(g, coef, off)
