"""GroupNorm (N, C, *spatial) on arrays, forward and backward (kernels: cuda_src/groupnorm.cu). Statistics are fp32
(float64 for float64 input on the reference path); the saved `mean` / `rstd` have shape (N, G).

    group_norm_forward(x, num_groups, weight, bias, eps, act=None) -> (y, mean, rstd)
    group_norm_backward(dy, x, num_groups, weight, mean, rstd, bias, act=None) -> (dx, dweight, dbias)

act="silu" fuses SiLU after the affine: y = silu(z), z = group_norm(x) * weight + bias, in one pass (z in fp32, never
stored); the backward takes dy of y and recomputes z from x and the saved mean / rstd. With act, `bias` (when given)
enters z and its gradient is returned; without, `bias` is passed only when its gradient is wanted.

channels_last=True (4-D x) writes y channels-last (memory N, H, W, C; the implicit-GEMM conv's operand): the
statistics by the cluster kernels (y not written) or the split path, then gn_apply_cl applies the affine and the
activation on the way through a tiled NCHW -> NHWC transpose. The backward is the same either way.

The switches shared with the layer / rms norms (single_launch_sums, the device properties) live in norms.py.
"""
import numpy as np

from .. import backend
from .. import memory_formats as MF
from ..errors import ShapeError
from . import column_sum as CS
from . import launching as KL
from . import loader as L
from . import norms as N
from . import plans as P
from .activations import _sigmoid_pair

_ACTS = {None: 0, "silu": 1}  # the kernels' act / ACT argument


def _act_code(act):
    if act not in _ACTS:
        raise ValueError(f"group_norm: act must be None or 'silu', got {act!r}")
    return _ACTS[act]


def _gn_check(x, num_groups, weight, bias):
    if x.ndim < 2:
        raise ShapeError(f"group_norm: expected input (N, C, *), got shape {tuple(x.shape)}")
    c = x.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise ShapeError(f"group_norm: {c} channels (input shape {tuple(x.shape)}) are not divisible into "
                         f"{num_groups} groups")
    N._check_affine("group_norm", weight, c, "weight")
    N._check_affine("group_norm", bias, c, "bias")


def _gn_ref(x, g, weight, bias, eps, act=None):
    """(y, mean, rstd) of group norm (then SiLU when act) on NumPy or CuPy arrays (the CPU's per-op path and the
    kernels' oracle): one working copy updated in place, the row means as norms._row_mean."""
    xp = backend.xp_of(x)
    n, c = x.shape[:2]
    cd = L.compute_dtype(x.dtype)
    xf = x.astype(cd).reshape(n, g, -1)   # the working copy
    mean = N._row_mean(xp, xf)
    xf -= mean
    var = N._row_mean(xp, xf * xf)
    var += cd(eps)
    xp.sqrt(var, out=var)
    rstd = xp.divide(1.0, var, out=var)
    xf *= rstd
    y = xf.reshape(n, c, -1)
    if weight is not None:
        y *= weight.astype(cd, copy=False)[:, None]
    if bias is not None:
        y += bias.astype(cd, copy=False)[:, None]
    if act == "silu":
        y *= _sigmoid_pair(xp, y)[0]
    return y.reshape(x.shape).astype(x.dtype, copy=False), mean[..., 0], rstd[..., 0]


def _gn_grad_ref(dy, x, g, weight, mean, rstd, bias, act=None):
    """(dx, dweight, dbias) of group norm (of SiLU(group norm) when act): dx = rstd (gw - mean(gw) - xhat
    mean(gw xhat)) per group, gw = dy w, in a few new arrays updated in place."""
    xp = backend.xp_of(x)
    n, c = x.shape[:2]
    cd = L.compute_dtype(x.dtype)
    g0 = dy.astype(cd, copy=False).reshape(n, c, -1)
    rs = rstd.astype(cd, copy=False)[..., None]
    xh = x.astype(cd).reshape(n, g, -1)   # a working copy: xhat
    xh -= mean.astype(cd, copy=False)[..., None]
    xh *= rs
    xh = xh.reshape(n, c, -1)
    if act == "silu":  # dz = dy silu'(z), z = xhat w + b recomputed
        z = xh * weight.astype(cd, copy=False)[:, None] if weight is not None else xh
        z = z + bias.astype(cd, copy=False)[:, None] if bias is not None else z
        s, q = _sigmoid_pair(xp, z)
        g0 = g0 * s * (1 + z * q)
    gw = g0 * weight.astype(cd, copy=False)[:, None] if weight is not None else g0
    gw_g, xh_g = gw.reshape(n, g, -1), xh.reshape(n, g, -1)
    p = gw_g * xh_g
    dot = N._row_mean(xp, p)
    xp.multiply(xh_g, dot, out=p)                    # xhat * dot
    dx = gw_g - N._row_mean(xp, gw_g)
    dx -= p
    dx *= rs
    dw = None
    if weight is not None:
        pw = p.reshape(n, c, -1)
        xp.multiply(g0, xh, out=pw)
        dw = pw.sum(axis=(0, 2)).astype(weight.dtype, copy=False)
    db = g0.sum(axis=(0, 2)).astype(bias.dtype, copy=False) if bias is not None else None
    return dx.reshape(x.shape).astype(x.dtype, copy=False), dw, db


def _gn_splits(rows, hw):
    return max(1, min(P.cdiv(P.sm_count() * 8, rows), P.cdiv(hw, 2048), 1024))


def _gn_partials(x, dy, rows, hw, splits, z=None):
    """z: (mean, rstd, weight, bias, C, cpg) of z = the affine's output where dy is of silu(z) (backward, act)."""
    xp = backend.xp_of(x)
    p0 = xp.empty((rows * splits,), dtype=np.float32)
    p1 = xp.empty((rows * splits,), dtype=np.float32)
    if z is None:
        zargs = (KL.null(), KL.null(), KL.null(), KL.null(), KL.i32(0), KL.i32(1), KL.i32(0))
    else:
        mean, rstd, weight, bias, c, cpg = z
        zargs = (mean, rstd, _f32_or_null(weight), _f32_or_null(bias), KL.i32(c), KL.i32(cpg), KL.i32(1))
    KL.launch(L.get_function("groupnorm", "gn_partials", x.dtype), (rows * splits,), (256,),
              (x, KL.null() if dy is None else dy, p0, p1, KL.i64(hw), KL.i32(splits)) + zargs)
    return p0, p1


def _f32_or_null(p):
    return KL.null() if p is None else P.contiguous(p.astype(np.float32, copy=False))


# One pass on sm_90+: a cluster of GN_CL blocks per (n, group) caches the group's x in shared memory
# (cuda_src/groupnorm.cu, gn_fwd_cluster / gn_bwd_cluster): x read once, y (dx) written once; the backward streams dy
# twice (its second read mostly from L2). Groups too large for the cluster's
# shared memory, older GPUs and `use_cluster = False` take the split path (chunk partials, finalize, apply).
GN_CL, GN_THREADS, GN_HEAD = 8, 256, 512  # as in cuda_src/groupnorm.cu
use_cluster = True
# The register-slice variants (gn_fwd_cluster_reg: x in registers, no shared-memory cache; gn_bwd_cluster_reg: dy in
# registers, read once) where a block's slice is <= max(GN_REG_V) * GN_THREADS 16-byte vectors; False: the shared-memory
# kernels only.
GN_REG_V = (2, 4, 6, 8, 10)  # the instantiated register slots per thread (12 spills on sm_90)
# The forward takes the register kernel up to this V only: on the H100 it was faster for small slices (2x1280x32x32,
# V 4: 0.0110 vs 0.0125 ms) and slower for large ones (2x320x128x128, V 10: 0.0219 vs 0.0205; 4 blocks per SM by
# registers against 5 by shared memory); the backward (dy read once) wins at every V measured.
GN_REG_FWD_MAX_V = 4
use_gn_reg = True
# The shared-memory forward's block statistics: two passes over its cache (0: mean, then M2 around it), one pass
# (1: sums of (x - c) and (x - c)^2 around the slice's first element c) or the same one pass as the slice loads (2:
# the copies in 4 commit groups, each summed as it lands, so the statistics are done with the load; on the H100
# 2x320x128x128 took 0.0206 / 0.0202 / 0.0195 ms in the three forms).
gn_one_pass = 2


def _gn_reg_v(x, cpg, hw, *arrays):
    """V of the register-slice kernels for this shape, or None (switched off, unaligned, not the vector path, or the
    slice is too large)."""
    vec = P.vec_width(x.dtype)
    if not use_gn_reg or hw % vec or any(a.data.ptr % 16 for a in (x,) + arrays):
        return None
    nv = P.cdiv(P.cdiv(cpg * hw, GN_CL), vec)
    return next((v for v in GN_REG_V if v * GN_THREADS >= nv), None)


def _gn_cluster_smem(x, cpg, hw, arrays):
    """Dynamic shared memory of the cluster kernels caching `arrays` slices of x's dtype, or None where it does not
    fit (or the GPU has no clusters)."""
    if not use_cluster or N._device_props()[4] < 90:
        return None
    vec = P.vec_width(x.dtype)
    vec = vec if hw % vec == 0 else 1
    s = P.cdiv(P.cdiv(cpg * hw, GN_CL), vec) * vec
    smem = GN_HEAD + arrays * s * x.dtype.itemsize
    return smem if smem <= N._device_props()[3] - 1024 else None


def _gn_fwd_cluster(x, g, weight, bias, eps, smem, act, write=True):
    """(y, mean, rstd) by the one-pass cluster kernels; write=False: the statistics only (y None)."""
    xp = backend.xp_of(x)
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    y = xp.empty_like(x) if write else None
    mean = xp.empty((n, g), dtype=np.float32)
    rstd = xp.empty((n, g), dtype=np.float32)
    v = _gn_reg_v(x, c // g, hw, *(() if y is None else (y,)))
    v = v if v is not None and v <= GN_REG_FWD_MAX_V else None
    name = (f"gn_fwd_cluster<{{T}}, 8, {gn_one_pass}, {act}>" if v is None
            else f"gn_fwd_cluster_reg<{{T}}, {v}, {act}>")
    smem = smem if v is None else GN_HEAD
    KL.launch(L.get_function("groupnorm", name, x.dtype), (n * g * GN_CL,), (GN_THREADS,),
              (x, _f32_or_null(weight), _f32_or_null(bias), KL.null() if y is None else y, mean, rstd, KL.i32(g),
               KL.i32(c // g), KL.i64(hw), KL.f32(eps)), shared_mem=smem)
    return y, mean, rstd


def _gn_apply_cl(x, g, weight, bias, mean, rstd, act):
    """y (shape of x, memory N, H, W, C) = act(group-normalised x * w + b) from the statistics mean / rstd (N, G):
    the affine fused with the NCHW -> NHWC transpose (gn_apply_cl; 16-byte accesses where the sizes allow)."""
    xp = backend.xp_of(x)
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    y = MF.empty(x.shape, x.dtype, xp, MF.channels_last)
    vec = x.dtype.itemsize == 2 and hw % 8 == 0 and c % 8 == 0 and x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
    KL.launch(L.get_function("groupnorm", "gn_apply_cl", x.dtype), (P.cdiv(hw, 64), P.cdiv(c, 64), n), (256,),
              (x, mean, rstd, _f32_or_null(weight), _f32_or_null(bias), y, KL.i32(c), KL.i32(g), KL.i64(hw),
               KL.i32(act), KL.i32(vec)))
    return y


def _gn_bwd_cluster(dy, x, g, weight, mean, rstd, bias, smem, act):
    xp = backend.xp_of(x)
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    dx = xp.empty_like(x)
    dw_part = xp.empty((n * GN_CL, c), dtype=np.float32) if weight is not None else None
    db_part = xp.empty((n * GN_CL, c), dtype=np.float32) if bias is not None else None
    fused = N.single_launch_sums and (weight is not None or bias is not None)
    dw = db = None
    if fused:  # the last block of each group sums the group's columns: outputs in x's dtype, else fp32 (then cast)
        odt = x.dtype if all(p is None or p.dtype == x.dtype for p in (weight, bias)) else np.dtype(np.float32)
        dw = xp.empty((c,), dtype=odt) if weight is not None else None
        db = xp.empty((c,), dtype=odt) if bias is not None else None
        fin = (KL.null() if dw is None else dw, KL.null() if db is None else db, CS.reduction_counters(g),
               KL.i32(odt != x.dtype))
    else:
        fin = (KL.null(), KL.null(), KL.null(), KL.i32(0))
    v = None if fused else _gn_reg_v(x, c // g, hw, dy, dx)
    args = (dy, x, _f32_or_null(weight), _f32_or_null(bias) if act else KL.null(), mean, rstd, dx,
            KL.null() if dw_part is None else dw_part,
            KL.null() if db_part is None else db_part, KL.i32(g), KL.i32(c // g), KL.i64(hw))
    if v is None:
        KL.launch(L.get_function("groupnorm", f"gn_bwd_cluster<{{T}}, 8, {act}>", x.dtype), (n * g * GN_CL,),
                  (GN_THREADS,), args + fin, shared_mem=smem)
    else:
        KL.launch(L.get_function("groupnorm", f"gn_bwd_cluster_reg<{{T}}, {v}, {act}>", x.dtype), (n * g * GN_CL,),
                  (GN_THREADS,), args, shared_mem=smem)
    if fused:
        return (dx, None if dw is None else dw.astype(weight.dtype, copy=False),
                None if db is None else db.astype(bias.dtype, copy=False))
    dw = CS.column_sum("groupnorm", "gn_column_sum", dw_part, weight.dtype) if weight is not None else None
    db = CS.column_sum("groupnorm", "gn_column_sum", db_part, bias.dtype) if bias is not None else None
    return dx, dw, db


def _gn_fwd_kernel(x, g, weight, bias, eps, act, channels_last=False):
    """channels_last: the statistics by either path below, then y written channels-last by _gn_apply_cl."""
    xp = backend.xp_of(x)
    x = P.contiguous(x)
    # the kernels read float32 weights: converted once here (the statistics and the channels-last apply both read them)
    weight, bias = (None if p is None else P.contiguous(p.astype(np.float32, copy=False)) for p in (weight, bias))
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    smem = _gn_cluster_smem(x, c // g, hw, 1)
    if smem is not None:
        y, mean, rstd = _gn_fwd_cluster(x, g, weight, bias, eps, smem, act, write=not channels_last)
        return (_gn_apply_cl(x, g, weight, bias, mean, rstd, act) if channels_last else y), mean, rstd
    rows, splits = n * c, _gn_splits(n * c, hw)
    p0, p1 = _gn_partials(x, None, rows, hw, splits)
    mean = xp.empty((n, g), dtype=np.float32)
    rstd = xp.empty((n, g), dtype=np.float32)
    a = xp.empty((rows,), dtype=np.float32)
    b = xp.empty((rows,), dtype=np.float32)
    KL.launch(L.get_function("groupnorm", "gn_fwd_finalize"), (P.cdiv(n * g, 128),), (128,),
              (p0, p1, _f32_or_null(weight), _f32_or_null(bias), mean, rstd, a, b, KL.i32(n), KL.i32(c), KL.i32(g),
              KL.i64(hw), KL.i32(splits), KL.i32(P.vec_width(x.dtype)), KL.f32(eps)))
    if channels_last:
        return _gn_apply_cl(x, g, weight, bias, mean, rstd, act), mean, rstd
    y = xp.empty_like(x)
    grid, block = P.elementwise_grid(x.size, x.dtype)
    KL.launch(L.get_function("groupnorm", "gn_apply", x.dtype), grid, block,
              (x, a, b, y, KL.i64(x.size), KL.i64(hw), KL.i32(act)))
    return y, mean, rstd


def _gn_bwd_kernel(dy, x, g, weight, mean, rstd, bias, act):
    xp = backend.xp_of(x)
    x = P.contiguous(x)
    dy = P.contiguous(dy.astype(x.dtype, copy=False))
    mean = P.contiguous(mean.astype(np.float32, copy=False))
    rstd = P.contiguous(rstd.astype(np.float32, copy=False))
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    smem = _gn_cluster_smem(x, c // g, hw, 1)  # the backward caches x only (dy is streamed)
    if smem is not None:
        return _gn_bwd_cluster(dy, x, g, weight, mean, rstd, bias, smem, act)
    rows, splits = n * c, _gn_splits(n * c, hw)
    p0, p1 = _gn_partials(x, dy, rows, hw, splits, (mean, rstd, weight, bias, c, c // g) if act else None)
    p, q, r = (xp.empty((rows,), dtype=np.float32) for _ in range(3))
    za = xp.empty((rows,), dtype=np.float32) if act else None
    zb = xp.empty((rows,), dtype=np.float32) if act else None
    dw_part = xp.empty((n, c), dtype=np.float32) if weight is not None else None
    db_part = xp.empty((n, c), dtype=np.float32) if bias is not None else None
    fused = N.single_launch_sums and (weight is not None or bias is not None)
    dw = xp.empty((c,), dtype=np.float32) if fused and weight is not None else None
    db = xp.empty((c,), dtype=np.float32) if fused and bias is not None else None
    KL.launch(L.get_function("groupnorm", "gn_bwd_finalize"), (P.cdiv(n * g, 128),), (128,),
              (p0, p1, _f32_or_null(weight), mean, rstd, p, q, r,
              KL.null() if dw_part is None else dw_part, KL.null() if db_part is None else db_part,
              KL.i32(n), KL.i32(c), KL.i32(g), KL.i64(hw), KL.i32(splits), KL.null() if dw is None else dw,
              KL.null() if db is None else db, CS.reduction_counters(1) if fused else KL.null(),
              _f32_or_null(bias) if act else KL.null(), KL.null() if za is None else za,
              KL.null() if zb is None else zb))
    dx = xp.empty_like(x)
    grid, block = P.elementwise_grid(x.size, x.dtype)
    KL.launch(L.get_function("groupnorm", "gn_bwd_apply", x.dtype), grid, block,
              (dy, x, p, q, r, KL.null() if za is None else za, KL.null() if zb is None else zb, dx, KL.i64(x.size),
               KL.i64(hw), KL.i32(act)))
    if fused:  # summed by gn_bwd_finalize's last block (fp32)
        return (dx, None if dw is None else dw.astype(weight.dtype, copy=False),
                None if db is None else db.astype(bias.dtype, copy=False))
    dw = CS.column_sum("groupnorm", "gn_column_sum", dw_part, weight.dtype) if weight is not None else None
    db = CS.column_sum("groupnorm", "gn_column_sum", db_part, bias.dtype) if bias is not None else None
    return dx, dw, db


def group_norm_forward(x, num_groups, weight=None, bias=None, eps=1e-5, act=None, channels_last=False):
    """(y, mean, rstd); channels_last (x 4-D): y is written channels-last (memory N, H, W, C; shape as x's)."""
    code = _act_code(act)
    _gn_check(x, num_groups, weight, bias)
    if channels_last and x.ndim != 4:
        raise ShapeError(f"group_norm: a channels-last output needs a 4-D (N, C, H, W) input, got shape "
                         f"{tuple(x.shape)}")
    if L.use_kernel(x) and x.size:
        return _gn_fwd_kernel(x, num_groups, weight, bias, eps, code, channels_last)
    y, mean, rstd = _gn_ref(x, num_groups, weight, bias, eps, act)
    return (MF.to_format(y, MF.channels_last) if channels_last else y), mean, rstd


def group_norm_backward(dy, x, num_groups, weight, mean, rstd, bias=None, act=None):
    code = _act_code(act)
    _gn_check(x, num_groups, weight, bias)
    if tuple(dy.shape) != tuple(x.shape):
        raise ShapeError(f"group_norm: gradient shape {tuple(dy.shape)} differs from input shape {tuple(x.shape)}")
    if L.use_kernel(x) and x.size:
        return _gn_bwd_kernel(dy, x, num_groups, weight, mean, rstd, bias, code)
    return _gn_grad_ref(dy, x, num_groups, weight, mean, rstd, bias, act)
