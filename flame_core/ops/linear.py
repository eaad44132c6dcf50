"""linear: y = x @ W^T + b as one 2-D GEMM over all leading dimensions (cuBLAS reads W^T in place, no copy);
linear_cat2: linear(cat((a, b), -1), W, b) without building the concatenation; linear_low_rank: linear with LoRA
updates of row blocks accumulated inside the GEMMs (no delta tensors, no adds)."""
import ml_dtypes as _ml
import numpy as _np

from .. import backend
from ..amp import autocast_mode as _amp
from ..autograd.function import Function
from ..autograd.grad_mode import is_grad_enabled
from ..errors import DTypeError, ShapeError, fmt_shape
from ..kernels import gemm as _cublas
from ..kernels import gemm_lt as _cublas_lt
from ..kernels import gemm_small as _small
from ..tensor import Tensor, _wrap, check_same_device
from .linalg import mm_arrays
from .shape import cat

_cupy_nd = backend._cupy_ndarray   # cupy.ndarray, or () without CuPy (no array's type)


def _linear_arrays(a, w, b):
    """a (M, in) @ w^T + b on arrays: on cuda with the bias added by the GEMM's epilogue (cuBLASLt), else a GEMM
    and an add."""
    if b is not None and backend.is_cuda_array(a):
        y = _cublas_lt.matmul_bias(a, w.T, b)
        if y is not None:
            return y
    y = mm_arrays(a, w.T)
    if b is not None:
        y += b
    return y


class Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b):
        a = x._data
        y = None
        if type(a) is _cupy_nd:   # cuda's per-op paths: a small product's own kernel, else cuBLASLt's bias epilogue
            y = _small.linear(a, w._data, None if b is None else b._data)
            if y is None and b is not None:
                y = _cublas_lt.linear_bias(a, w._data, b._data)
        if y is None:
            y = _linear_arrays(a.reshape(-1, a.shape[-1]), w._data, None if b is None else b._data)  # (M, out)
            y = y.reshape(a.shape[:-1] + (w._data.shape[0],))
        # keep only what the wanted gradients use (as PyTorch): a frozen weight's Linear keeps no input
        nx, nw, _ = ctx.needs_input_grad
        ctx.save_for_backward(x if nw else None, w if nx else None)
        ctx.x_shape = x._data.shape
        return _wrap(y)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad
        if not is_grad_enabled():   # the usual backward: on the arrays (no Tensor op, no node, no reshape Function)
            return _linear_grads(g._data, x, w, ctx.x_shape, nx, nw, nb)
        # create_graph (double backward): Tensor ops, which record
        g2 = g.reshape(-1, g.shape[-1])  # (M, out)
        dx = (g2 @ w).reshape(ctx.x_shape) if nx else None
        dw = g2.mT @ x.reshape(-1, x.shape[-1]) if nw else None
        db = g2.sum(0) if nb else None
        return dx, dw, db


def _linear_grads(gd, x, w, x_shape, nx, nw, nb):
    """Linear's (dx, dW, db) on arrays from the output gradient's array gd (..., out): dx = g W, dW = g^T x, db =
    g.sum(0) (half types summed in float32); on cuda dW and db come from one cuBLASLt matmul where it applies
    (gemm_lt.weight_bias_grad: the bias gradient reduced in the GEMM's epilogue)."""
    g2 = gd if gd.ndim == 2 else gd.reshape(-1, gd.shape[-1])   # (M, out); a 2-D array as it is (no view object)
    if type(g2) is _cupy_nd:   # a small problem: dx, dW and db from one launch of FLAME's own kernel
        xd = x._data if nw else None
        r = _small.linear_grads(g2, None if xd is None else (xd if xd.ndim == 2 else xd.reshape(-1, xd.shape[-1])),
                                w._data if nx else None, nx, nw, nb)
        if r is not None:
            d, dw, db = r
            return (None if d is None else _wrap(d if d.shape == x_shape else d.reshape(x_shape)),
                    None if dw is None else _wrap(dw), None if db is None else _wrap(db))
    dx = dw = db = None
    if nx:
        d = _gemm(g2, w._data)
        dx = _wrap(d if d.shape == x_shape else d.reshape(x_shape))
    if nw:
        xd = x._data
        x2 = xd if xd.ndim == 2 else xd.reshape(-1, xd.shape[-1])
        pair = _cublas_lt.weight_bias_grad(g2, x2) if nb and backend.is_cuda_array(g2) else None
        if pair is not None:
            return dx, _wrap(pair[0]), _wrap(pair[1])
        dw = _wrap(_gemm(g2.T, x2))
    if nb:
        xp = backend.xp_of(g2)
        if g2.dtype.itemsize < 4:   # half types accumulate in float32, as Tensor.sum
            db = xp.sum(g2, axis=0, dtype=_np.float32).astype(g2.dtype)
        else:
            db = xp.sum(g2, axis=0)
        db = _wrap(db)
    return dx, dw, db


_LINEAR_DTYPES = frozenset(_np.dtype(d) for d in (_np.float16, _np.float32, _np.float64, _ml.bfloat16))


def linear(input, weight, bias=None):
    """PyTorch's F.linear: input (*, in), weight (out, in), bias (out,) -> (*, out)."""
    if not _amp.active and isinstance(input, Tensor) and isinstance(weight, Tensor):
        # the common case's checks on the arrays (no Size, dtype or device objects); anything else: see below
        xd, wd = input._data, weight._data
        ws = wd.shape
        if (len(ws) == 2 and xd.ndim and xd.shape[-1] == ws[1] and type(xd) is type(wd)
                and xd.dtype is wd.dtype and xd.dtype in _LINEAR_DTYPES and not (input._f8 or weight._f8)):
            if bias is None:
                return Linear.apply(input, weight, None)
            bd = bias._data if isinstance(bias, Tensor) else None
            if type(bd) is type(wd) and bd.dtype is wd.dtype and bd.shape == ws[:1] and not bias._f8:
                return Linear.apply(input, weight, bias)
    check_same_device("linear", input, weight, bias)
    if weight.ndim != 2 or input.ndim < 1 or input.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: input {fmt_shape(input.shape)} and weight {fmt_shape(weight.shape)} do not fit "
                         f"(expected weight (out_features, {input.shape[-1] if input.ndim else '?'}))")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ShapeError(f"linear: bias {fmt_shape(bias.shape)} for {weight.shape[0]} output features")
    if _amp.active:
        input, weight, bias = _amp.cast_inputs("lower", input, weight, bias)
    if input.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise DTypeError(f"linear: input ({input.dtype}), weight ({weight.dtype})"
                         + (f" and bias ({bias.dtype})" if bias is not None else "")
                         + " must have the same dtype (cast them, or use flame.amp.autocast)")
    if not input.dtype.is_floating_point:
        raise DTypeError(f"linear: expected floating point tensors, got {input.dtype}")
    return Linear.apply(input, weight, bias)


class LinearCat2(Function):
    """linear(cat((a, b), -1), w, bias) without building the concatenation: a @ w[:, :Ha]^T + bias (on cuda the bias
    in that GEMM's epilogue), then b @ w[:, Ha:]^T accumulated into the same output by the second GEMM (cuBLAS beta =
    1). Backward: the two input gradients come out separately (no split of a concatenated gradient)."""

    @staticmethod
    def forward(ctx, a, b, w, bias):
        ha = a.shape[-1]
        lead = a.shape[:-1]
        a2 = a._data.reshape(-1, ha)
        b2 = b._data.reshape(-1, b.shape[-1])
        wd = w._data
        if backend.is_cuda_array(wd) and _cublas.supported(wd.dtype) and a2.dtype == b2.dtype == wd.dtype:
            # the bias in the first GEMM's epilogue (cuBLASLt), not an add pass over the output afterwards
            y = _linear_arrays(a2, wd[:, :ha], None if bias is None else bias._data)
            _cublas.matmul(b2, wd[:, ha:].T, out=y, beta=1.0)
        else:
            y = mm_arrays(a2, wd[:, :ha].T)
            y += mm_arrays(b2, wd[:, ha:].T)
            if bias is not None:
                y += bias._data
        na, nb, nw, _ = ctx.needs_input_grad
        # the inputs only for the weight's gradient (a frozen weight keeps neither), the weight for theirs
        ctx.save_for_backward(a if nw else None, b if nw else None, w if (na or nb) else None)
        ctx.shapes = (a.shape, b.shape)
        return _wrap(y.reshape(lead + (wd.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        a, b, w = ctx.saved_tensors
        na, nb, nw, nbias = ctx.needs_input_grad
        sa, sb = ctx.shapes
        ha = sa[-1]
        g2 = g.reshape(-1, g.shape[-1])
        da = (g2 @ w[:, :ha]).reshape(sa) if na else None
        db = (g2 @ w[:, ha:]).reshape(sb) if nb else None
        dw = None
        if nw:
            dw = cat((g2.mT @ a.reshape(-1, ha), g2.mT @ b.reshape(-1, b.shape[-1])), dim=1)
        dbias = g2.sum(0) if nbias else None
        return da, db, dw, dbias


def linear_cat2(a, b, weight, bias=None):
    """linear(cat((a, b), -1), weight, bias) as one fused op (see LinearCat2); autocast-aware like linear."""
    if _amp.active:
        a, b, weight, bias = _amp.cast_inputs("lower", a, b, weight, bias)
    if a.shape[:-1] != b.shape[:-1] or a.shape[-1] + b.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear_cat2: inputs {tuple(a.shape)} and {tuple(b.shape)} do not fit a weight of shape "
                         f"{tuple(weight.shape)}")
    return LinearCat2.apply(a, b, weight, bias)


def _gemm(a, b, out=None, alpha=1.0, beta=0.0):
    """out = alpha * (a @ b) + beta * out on 2-D arrays (out may be a column block of a wider row-major matrix):
    cuBLAS on cuda, so a product accumulates into `out` without a temporary; NumPy (half types in float32)."""
    if backend.is_cuda_array(a) and a.dtype == b.dtype and _cublas.supported(a.dtype):
        return _cublas.matmul(a, b, out=out, alpha=alpha, beta=beta)
    wide = _np.float32 if a.dtype in (_np.float16, _cublas.BF16) else a.dtype   # half types sum in float32 (cuBLAS)
    p = mm_arrays(a.astype(wide, copy=False), b.astype(wide, copy=False))
    if alpha != 1.0:
        p *= alpha
    if out is None:
        return p.astype(a.dtype, copy=False)
    out[...] = p if beta == 0.0 else out.astype(wide) * beta + p
    return out



# ----------------------------------------------------------------------------- the low-rank parts, on arrays
# (shared by LinearLowRank and the fp8-compute base's fused op, flame_nn.offload.fp8_compute)
def _stacked_down(factors, n):
    """A_1 .. A_n (r_i, in) stacked as one (Σr, in) array (the array itself for one adapter)."""
    if n == 1:
        return factors[0]
    return backend.xp_of(factors[0]).concatenate([factors[2 * i] for i in range(n)], axis=0)


def low_rank_forward(a, y, factors, blocks):
    """y[:, lo_i:hi_i] += s_i · (a A_i^T) B_i^T for every block, accumulated inside the GEMMs (y (N, out), written
    in place; factors = [A_1, B_1, A_2, B_2, ...] arrays of a's dtype). Returns h (N, Σr): every a A_i^T side by side
    (what B_i's gradient reads), made by ONE GEMM over the stacked A_i: the adapters of a fused projection (Flux's
    q | k | v) share the input, which is then read once, not once per adapter."""
    if not blocks:
        return backend.xp_of(a).empty((a.shape[0], 0), dtype=a.dtype)
    h = _gemm(a, _stacked_down(factors, len(blocks)).T)               # (N, Σr)
    off = 0
    for i, (lo, hi, s) in enumerate(blocks):
        r = factors[2 * i].shape[0]
        _gemm(h[:, off:off + r], factors[2 * i + 1].T, out=y[:, lo:hi], alpha=s, beta=1.0)
        off += r
    return h


def output_parts(y, lead, splits):
    """y (N, out) as one tensor of shape lead + (out,), or (splits) as that many column-block views of it."""
    if splits is None:
        return _wrap(y.reshape(tuple(lead) + (y.shape[1],)))
    parts, lo = [], 0
    for n in splits:
        parts.append(_wrap(y[:, lo:lo + n].reshape(tuple(lead) + (n,))))   # column blocks: views of y
        lo += n
    return tuple(parts)


def gradient_parts(gs, splits):
    """([(lo, (N, n) array)], out features) of the output gradients `gs` (one per split part, or one); a part whose
    output got no gradient (None) is left out (it is zero)."""
    parts, lo = [], 0
    for g, n in zip(gs, splits or (None,)):
        if g is not None:
            parts.append((lo, g._data.reshape(-1, g.shape[-1])))
        lo += g.shape[-1] if n is None else n
    return parts, lo


def low_rank_backward(parts, xd, dx, factors, blocks, h, needs):
    """The adapters' part of the backward, on arrays: dx (N, in) += Σ s_i (g_i B_i) A_i in place (dx None: not
    wanted), g_i the column block [lo_i, hi_i) of the output gradient read in place from `parts` (gradient_parts).
    needs: [need A_1, need B_1, ...]; xd (N, in) the input and h the forward's (N, Σr) where the factors train.
    Returns [dA_1, dB_1, ...] arrays (None where not needed; zeros where the block got no gradient).

    The adapters share the input: their dh_i = s_i g_i B_i go side by side into one (N, Σr) array, and dx and the
    A_i's gradients come from ONE GEMM each over it and the stacked A_i (dx read and written once, x read once),
    not one per adapter."""

    def cols(lo_, hi_):
        for p0, gd in parts:
            if p0 <= lo_ and hi_ <= p0 + gd.shape[1]:
                return gd[:, lo_ - p0:hi_ - p0]
        return None
    n = len(blocks)
    ranks = [factors[2 * i].shape[0] for i in range(n)]
    gis = [cols(lo, hi) for lo, hi, _ in blocks]                        # column blocks of g, read in place
    got = [g is not None for g in gis]
    need_a = any(needs[2 * i] for i in range(n))
    da_all = None
    if any(got) and (dx is not None or need_a):
        g0 = next(g for g in gis if g is not None)
        xp = backend.xp_of(g0)
        dh = (xp.empty if all(got) else xp.zeros)((g0.shape[0], sum(ranks)), dtype=g0.dtype)   # (N, Σr)
        off = 0
        for i, (_, _, s) in enumerate(blocks):
            if got[i]:
                _gemm(gis[i], factors[2 * i + 1], out=dh[:, off:off + ranks[i]], alpha=s)   # s_i g_i B_i
            off += ranks[i]
        if dx is not None:
            _gemm(dh, _stacked_down(factors, n), out=dx, beta=1.0)     # dx += Σ dh_i A_i
        if need_a:
            da_all = _gemm(dh.T, xd)                                    # (Σr, in): every dA_i
    grads, off = [], 0
    for i, (lo, hi, s) in enumerate(blocks):
        ad, bd = factors[2 * i], factors[2 * i + 1]
        r = ranks[i]
        da = db = None
        if needs[2 * i]:
            da = da_all[off:off + r] if got[i] else backend.xp_of(ad).zeros_like(ad)
        if needs[2 * i + 1]:
            db = _gemm(gis[i].T, h[:, off:off + r], alpha=s) if got[i] else backend.xp_of(bd).zeros_like(bd)
        grads += [da, db]
        off += r
    return grads


def bias_grad(parts, n_out, dtype, xp):
    """The bias gradient (n_out,) of `dtype` from the output gradient's parts (half types summed in float32)."""
    acc = xp.float32 if dtype in (_np.float16, _cublas.BF16) else dtype
    db = xp.zeros((n_out,), dtype=dtype)
    for p0, gd in parts:
        db[p0:p0 + gd.shape[1]] = gd.sum(0, dtype=acc).astype(dtype, copy=False)
    return db


class LinearLowRank(Function):
    """linear(x, W, b) plus low-rank updates of output-row blocks, as one node (LoRA on a Linear or on row blocks of
    a fused qkv projection):

        y = x W^T + b;   y[..., lo_i:hi_i] += s_i · (x A_i^T) B_i^T        A_i (r_i, in), B_i (hi_i - lo_i, r_i)

    The rank-r products accumulate into y's row blocks inside the GEMM (cuBLAS beta = 1, the scale as its alpha), so
    no (N, out) delta is formed or added; backward likewise accumulates x's gradient from the adapters into the base
    product's (dx = g W + Σ s_i (g_i B_i) A_i) and reads each g_i as a column block of g in place. Saved: x when a
    factor trains, the (N, Σr) intermediates x A_i^T, the weights. Inputs: x, W, b, then A_1, B_1, A_2, B_2, ...;
    `blocks` = ((lo, hi, s), ...) per adapter.

    `splits` (sizes summing to out, or None): the output comes back as that many column-block views of one GEMM's
    result instead of one tensor (a fused projection whose parts feed different ops: Flux's single-block linear1 as
    q | k | v | mlp). Backward then takes the parts' gradients as they come, dx = Σ_p g_p W_p (each GEMM after the
    first accumulating into dx), instead of concatenating them into one (N, out) gradient first: a Split node's
    backward copies every part and briefly holds both the parts and their concatenation."""

    @staticmethod
    def forward(ctx, x, w, bias, blocks, splits, *factors):
        a = x._data.reshape(-1, x.shape[-1])
        y = _linear_arrays(a, w._data, None if bias is None else bias._data)
        h = low_rank_forward(a, y, [f._data for f in factors], blocks)
        need = ctx.needs_input_grad
        nx, nw = need[0], need[1]
        train = any(need[5:])
        ctx.save_for_backward(x if (nw or train) else None, w if nx else None, *factors)
        ctx.h = h if train else None
        ctx.blocks, ctx.x_shape, ctx.splits = blocks, x.shape, splits
        return output_parts(y, x.shape[:-1], splits)

    @staticmethod
    def backward(ctx, *gs):
        if is_grad_enabled():
            raise RuntimeError("linear_low_rank: double backward (create_graph=True) through fused low-rank adapters "
                               "is not supported; set `fuse_lora = False` on the adapted layers")
        x, w, *factors = ctx.saved_tensors
        need = ctx.needs_input_grad
        nx, nw, nb = need[0], need[1], need[2]
        wd = w._data if w is not None else None
        parts, n_out = gradient_parts(gs, ctx.splits)
        xp = backend.xp_of(parts[0][1]) if parts else None
        xd = None if x is None else x._data.reshape(-1, x.shape[-1])
        rows = int(_np.prod(ctx.x_shape[:-1]))
        dt = parts[0][1].dtype if parts else None
        dx = None
        if nx:
            if parts:
                for k, (p0, gd) in enumerate(parts):                     # dx = Σ g_p W_p
                    dx = _gemm(gd, wd[p0:p0 + gd.shape[1]], out=dx, beta=1.0 if k else 0.0)
            else:
                dx = backend.xp_of(wd).zeros((rows, ctx.x_shape[-1]), dtype=wd.dtype)
        grads = low_rank_backward(parts, xd, dx if nx else None, [f._data for f in factors], ctx.blocks, ctx.h,
                                  need[5:])
        dw = dbias = None
        if nw or nb:
            xp = xp or backend.xp_of(xd if xd is not None else wd)
            full = ctx.splits is None and len(parts) == 1
            if nw:
                if full:
                    dw = _gemm(parts[0][1].T, xd)
                else:
                    dw = xp.zeros((n_out, ctx.x_shape[-1]), dtype=dt or xd.dtype)
                    for p0, gd in parts:
                        _gemm(gd.T, xd, out=dw[p0:p0 + gd.shape[1]])
                dw = _wrap(dw)
            if nb:
                dbias = _wrap(bias_grad(parts, n_out, dt or x.dtype.np, xp))
        dx = _wrap(dx.reshape(ctx.x_shape)) if nx else None
        return (dx, dw, dbias, None, None, *(None if g is None else _wrap(g) for g in grads))


def linear_low_rank(input, weight, bias, factors, splits=None):
    """linear(input, weight, bias) with low-rank updates on output-row blocks as one fused op (see LinearLowRank):
    `factors` = [(A (r, in), B (hi - lo, r), lo, hi, scale), ...]; autocast-aware like `linear` (the factors are
    cast with the weight, so float32 adapter parameters run in bf16 under bf16 autocast, as PEFT's). `splits`:
    output sizes summing to out_features -> a tuple of column-block views, as `.split(splits, -1)` of the output
    but without the split's concatenating backward (see LinearLowRank)."""
    tensors = [input, weight, bias] + [t for f in factors for t in f[:2]]
    if _amp.active:
        tensors = list(_amp.cast_inputs("lower", *tensors))
    input, weight, bias, *ab = tensors
    check_same_device("linear_low_rank", *tensors)
    n_in = weight.shape[1]
    if weight.ndim != 2 or input.shape[-1] != n_in:
        raise ShapeError(f"linear_low_rank: input {fmt_shape(input.shape)} and weight {fmt_shape(weight.shape)} "
                         f"do not fit")
    blocks, splits = low_rank_blocks("linear_low_rank", factors, ab, tuple(weight.shape), splits)
    dts = {t.dtype for t in tensors if t is not None}
    if len(dts) != 1:
        raise DTypeError(f"linear_low_rank: input, weight, bias and factors must share one dtype, got "
                         f"{sorted(str(d) for d in dts)} (cast them, or use flame.amp.autocast)")
    return LinearLowRank.apply(input, weight, bias, blocks, splits, *ab)


def low_rank_blocks(op, factors, ab, weight_shape, splits):
    """(blocks ((lo, hi, scale), ...), splits as a tuple or None) of a fused low-rank op's arguments, checked against
    a weight of `weight_shape` (out, in): `factors` [(A, B, lo, hi, scale)], `ab` the A and B tensors to use."""
    n_out, n_in = weight_shape
    blocks = []
    for i, (_, _, lo, hi, s) in enumerate(factors):
        a, b = ab[2 * i], ab[2 * i + 1]
        if not (0 <= lo < hi <= n_out and a.ndim == 2 and b.ndim == 2 and a.shape[1] == n_in
                and tuple(b.shape) == (hi - lo, a.shape[0])):
            raise ShapeError(f"{op}: factors A {fmt_shape(a.shape)}, B {fmt_shape(b.shape)} do not fit "
                             f"rows [{lo}:{hi}] of a weight {fmt_shape(weight_shape)}")
        blocks.append((int(lo), int(hi), float(s)))
    if splits is not None:
        splits = tuple(int(n) for n in splits)
        if any(n <= 0 for n in splits) or sum(splits) != n_out:
            raise ShapeError(f"{op}: splits {splits} must be positive and sum to the {n_out} output features")
    return tuple(blocks), splits
