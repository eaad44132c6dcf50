"""RMSNorm of one or two strided (B, L_p, H, D) parts written as one contiguous (B, L0 + L1, H, D) array, part 0's
tokens first (kernels: cuda_src/joint_rms_norm.cu): the q or k of a joint attention normalised straight out of the
qkv projection's views, with no copies of them and no concatenation.

    joint_rms_norm_forward(xs, ws, eps, rope=None)     -> y (B, sum L_p, H, D), contiguous, xs' dtype
    joint_rms_norm_backward(g, xs, ws, eps, rope=None) -> [dx_p (B, L_p, H, D) contiguous]  (the gains and the
                                                          rotations are not differentiated)

xs: one or two arrays of one dtype with equal B, H, D (any strides, the last dim's 1 on the kernel path); ws: a (D,)
gain per part (its dtype or float32) or None. Statistics in fp32 (float64 for float64), y = (x * rstd) * w.
rope: Flux's rotary embedding applied to y before its one rounding (y[..., 2j : 2j + 2] <- f_j y[..., 2j : 2j + 2] with
the 2x2 matrix f_j of y's token row), given as one table per joint token row, (B * sum L_p, 1, 1, D / 2, 2, 2) or
(B * sum L_p, D / 2, 2, 2) (flame_models.bfl.ops.rope_rows' layout) in float32 (float64 for float64 x): the attention
then reads q / k rotated with no RoPE pass of its own; the backward rotates the gradient back first (the transposed
matrices). The kernels apply it where a row's pairs lie in one thread's 16-byte vector; elsewhere (misaligned or
strided-by-odd views) rope.py's kernel rotates the normalised rows (or the gradient, first) as a pass of its own.
"""
import numpy as np

from .. import backend
from ..errors import ShapeError, fmt_shape
from . import launching as KL
from . import loader as L
from . import norms as N
from . import plans as P
from . import rope as R

MAX_D = 512  # the kernels cache 16 values of a row per thread, 32 threads per row at most
BLOCK = 256


def _check(xs, ws):
    if len(xs) not in (1, 2) or len(ws) != len(xs):
        raise ValueError(f"joint_rms_norm: one or two parts and a gain (or None) each, got {len(xs)} parts and "
                         f"{len(ws)} gains")
    x0 = xs[0]
    for i, x in enumerate(xs):
        if x.ndim != 4:
            raise ShapeError(f"joint_rms_norm: part {i} must be (B, L, H, D), got {fmt_shape(x.shape)}")
        if (x.shape[0], x.shape[2], x.shape[3]) != (x0.shape[0], x0.shape[2], x0.shape[3]) or x.dtype != x0.dtype:
            raise ShapeError(f"joint_rms_norm: part {i} {fmt_shape(x.shape)} {x.dtype} does not join part 0 "
                             f"{fmt_shape(x0.shape)} {x0.dtype} along dim 1 (B, H, D and dtype must agree)")
    for i, w in enumerate(ws):
        if w is not None and tuple(w.shape) != (x0.shape[3],):
            raise ShapeError(f"joint_rms_norm: gain {i} has shape {fmt_shape(w.shape)}, expected ({x0.shape[3]},)")


# ----------------------------------------------------------------------------- references
def _check_rope(rope, xs):
    """rope as (B * Lt, D / 2, 2, 2) (a view), after checking it against the parts."""
    B, _, _, D = xs[0].shape
    rows = B * sum(x.shape[1] for x in xs)
    want = (rows, D // 2, 2, 2)
    shape = tuple(rope.shape)
    if D % 2 or shape not in (want, (rows, 1, 1) + want[1:]):
        raise ShapeError(f"joint_rms_norm: rope tables {fmt_shape(shape)} do not fit parts of {rows} token rows "
                         f"(B x L0 + L1) and head dim {D}: expected {fmt_shape((rows, 1, 1) + want[1:])} or "
                         f"{fmt_shape(want)} (and an even head dim)")
    if rope.dtype not in (np.float32, np.float64):
        raise ShapeError(f"joint_rms_norm: rope tables must be float32 (float64 for float64 parts), got {rope.dtype}")
    return rope.reshape(want)


def _as_rope_rows(y, rope):
    """y (B, Lt, H, D) as rope.py's x (B * Lt, H, 1, D) and the tables as its freqs (B * Lt, 1, 1, D / 2, 2, 2): one
    table per token row, no transpose."""
    B, Lt, H, D = y.shape
    return y.reshape(B * Lt, H, 1, D), rope.reshape(B * Lt, 1, 1, D // 2, 2, 2)


def _rotate(y, rope, transpose):
    """y (B, Lt, H, D) rotated by the per-row tables with rope.py's reference, in y's dtype (the compute dtype here:
    the rotation comes before the one rounding)."""
    return R._rope_ref(*_as_rope_rows(y, rope), transpose).reshape(y.shape)


def _forward_ref(xs, ws, eps, rope=None):
    """norms.py's RMSNorm reference per part, concatenated; with rope, the rows rotated before the one rounding."""
    xp = backend.xp_of(xs[0])
    if rope is None:
        return xp.concatenate([N._layer_ref(x, w, None, eps, True)[0] for x, w in zip(xs, ws)], axis=1)
    cd = L.compute_dtype(xs[0].dtype)
    ys = []
    for x, w in zip(xs, ws):
        rstd = N._layer_ref(x, None, None, eps, True)[2].astype(cd)
        y = x.astype(cd) * rstd[..., None]
        ys.append(y * w.astype(cd) if w is not None else y)
    return _rotate(xp.concatenate(ys, axis=1), rope, False).astype(xs[0].dtype)


def _backward_ref(g, xs, ws, eps, rope=None):
    """norms.py's RMSNorm gradient reference per part, on that part's rows of the joint gradient (rotated back
    first with rope)."""
    if rope is not None:
        g = _rotate(g.astype(L.compute_dtype(xs[0].dtype)), rope, True)
    out, l0 = [], 0
    for x, w in zip(xs, ws):
        rstd = N._layer_ref(x, None, None, eps, True)[2]
        out.append(N._layer_grad_ref(g[:, l0:l0 + x.shape[1]], x, w, None, rstd, None, True)[0])
        l0 += x.shape[1]
    return out


# ----------------------------------------------------------------------------- kernels
def _plan(xs, others):
    """(G, vec) for the kernels (G threads per row, 16-byte vectors or not), or None: a part's last dim is strided or
    D is past MAX_D (use_kernel has checked the dtype)."""
    x0 = xs[0]
    D = x0.shape[3]
    if D > MAX_D or D == 0 or any(x.strides[3] != x.itemsize for x in xs if x.size):
        return None
    n = P.vec_width(x0.dtype)
    vec = D % n == 0 and all(x.data.ptr % 16 == 0 and all((s // x.itemsize) % n == 0 for s in x.strides[:3])
                             for x in xs) and all(a.data.ptr % 16 == 0 for a in others)
    per = n if vec else 1
    G = 1
    while G < 32 and G * per < D:
        G *= 2
    return G, int(vec)


def _part_args(xs, ws):
    args = []
    for i in range(2):
        if i < len(xs):
            x, w = xs[i], ws[i]
            sb, sl, sh = (s // x.itemsize for s in x.strides[:3])
            args += [x, KL.i64(sb), KL.i64(sl), KL.i64(sh), KL.i32(x.shape[1]), w]   # w: a pointer or null
        else:
            args += [KL.null(), KL.i64(0), KL.i64(0), KL.i64(0), KL.i32(0), KL.null()]
    return tuple(args)


def _grid(rows, G):
    rpb = BLOCK // G
    return (max(1, min(P.cdiv(rows, rpb), P.sm_count() * 16)),), (BLOCK,)


def _rope_arg(rope, vec):
    """The tables' kernel argument: null without rope, else contiguous fp32 (as rope.py's kernel reads them); None
    where the kernels cannot take them (no 16-byte vectors: a pair would straddle two threads)."""
    if rope is None:
        return KL.null()
    if not vec:
        return None
    rope = P.contiguous(rope.astype(np.float32, copy=False))
    return rope if rope.data.ptr % 16 == 0 else None


def _rope_pass(y, rope, transpose):
    """rope.py's kernel over y (B, Lt, H, D) seen as B * Lt rows of (H, 1, D), one table each (the fallback of the
    fused rotation)."""
    return (R.rope_backward if transpose else R.rope_forward)(*_as_rope_rows(y, rope)).reshape(y.shape)


def _forward_kernel(xs, ws, eps, rope=None):
    x0 = xs[0]
    B, _, H, D = x0.shape
    Lt = sum(x.shape[1] for x in xs)
    wa, wf32 = N._param_args(x0, *ws)   # pointers (null where absent): every gain in x's dtype, or every one fp32
    plan = _plan(xs, [a for a, w in zip(wa, ws) if w is not None])  # (new arrays start 256-byte aligned)
    if plan is None:
        return None
    ra = _rope_arg(rope, plan[1])
    if ra is None:  # the rotation as a pass of its own over the normalised rows
        y = _forward_kernel(xs, ws, eps)
        return None if y is None else _rope_pass(y, rope, False)
    y = backend.xp_of(x0).empty((B, Lt, H, D), dtype=x0.dtype)
    G, vec = plan
    grid, block = _grid(B * Lt * H, G)
    KL.launch(L.get_function("joint_rms_norm", "joint_rms_norm_fwd", x0.dtype), grid, block,
              _part_args(xs, wa) + (y, ra, KL.i32(B), KL.i32(H), KL.i32(D), KL.i32(G), KL.f32(eps), KL.i32(wf32),
                                    KL.i32(vec)))
    return y


def _backward_kernel(g, xs, ws, eps, rope=None):
    x0 = xs[0]
    B, _, H, D = x0.shape
    xp = backend.xp_of(x0)
    g = P.contiguous(g.astype(x0.dtype, copy=False))
    wa, wf32 = N._param_args(x0, *ws)
    plan = _plan(xs, [g] + [a for a, w in zip(wa, ws) if w is not None])
    if plan is None:
        return None
    ra = _rope_arg(rope, plan[1])
    if ra is None:  # the gradient rotated back by a pass of its own first
        return _backward_kernel(_rope_pass(g, rope, True), xs, ws, eps)
    dxs = [xp.empty(x.shape, dtype=x.dtype) for x in xs]
    G, vec = plan
    grid, block = _grid(g.shape[0] * g.shape[1] * H, G)
    # one 16-byte step covers a row: the kernel that holds two rows per thread group at once
    name = "joint_rms_norm_bwd_rows2" if vec and G * P.vec_width(x0.dtype) >= D else "joint_rms_norm_bwd"
    KL.launch(L.get_function("joint_rms_norm", name, x0.dtype), grid, block,
              _part_args(xs, wa) + (g, dxs[0], dxs[1] if len(dxs) > 1 else KL.null(), ra, KL.i32(B), KL.i32(H),
                                    KL.i32(D), KL.i32(G), KL.f32(eps), KL.i32(wf32), KL.i32(vec)))
    return dxs


# ----------------------------------------------------------------------------- API
def joint_rms_norm_forward(xs, ws, eps=1e-6, rope=None):
    _check(xs, ws)
    if rope is not None:
        rope = _check_rope(rope, xs)
    if L.use_kernel(*xs) and all(x.size for x in xs):
        y = _forward_kernel(xs, ws, eps, rope)
        if y is not None:
            return y
    return _forward_ref(xs, ws, eps, rope)


def joint_rms_norm_backward(g, xs, ws, eps=1e-6, rope=None):
    _check(xs, ws)
    if rope is not None:
        rope = _check_rope(rope, xs)
    B, _, H, D = xs[0].shape
    want = (B, sum(x.shape[1] for x in xs), H, D)
    if tuple(g.shape) != want:
        raise ShapeError(f"joint_rms_norm backward: gradient {fmt_shape(g.shape)}, expected {fmt_shape(want)}")
    if L.use_kernel(g, *xs) and all(x.size for x in xs):
        dxs = _backward_kernel(g, xs, ws, eps, rope)
        if dxs is not None:
            return dxs
    return _backward_ref(g, xs, ws, eps, rope)
