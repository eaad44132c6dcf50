"""fp8 compute for frozen fp8 Linears: the base matmul on the fp8 tensor cores instead of dequantising the weight.

    quantize_linear_weights_(blocks, compute="fp8")     # flame_nn.offload.fp8: storage + fp8 compute
    use_fp8_compute_(blocks)                            # layers already in fp8 storage (e.g. read from a file)

Forward:  y = scaled_mm(e4m3(x / s_x), W_q, s_x, s_w) + b   -- x quantised per tensor with the amax of this call
          ("current" scaling, one kernel: flame_core.kernels.fp8_tensor), W the stored e4m3 weight, the bias in the
          GEMM's epilogue, the output written in the compute dtype (flame_core.kernels.scaled_mm). Accumulation:
          FAST_ACCUM_FORWARD (torchao's float8 recipe: fast accumulation for the output, not for the gradients)
          leaves the tensor cores' partial sums unpromoted -- 5-9% off the GEMM's time (bench/fp8_gemm.py), its
          error measured by bench/fp8_quality.py and bench/fp8_lora_quality.py.
Backward: dX = scaled_mm(e4m3(dY / s_g), W_q^T, s_g, s_w)    -- dY quantised the same way, to e4m3 (current scaling
          bounds the range by the amax itself, so e5m2's wider range buys nothing and its one fewer mantissa bit would
          double the rounding error), read in whatever float dtype the gradient arrives (no cast pass first);
          partial sums promoted to fp32; W^T is W's bytes transposed into the fp8 scratch buffer per call (1 byte per
          weight, cheaper than the bf16 path's dequantisation, which writes 2): no second weight copy stays resident
          -- unless cache_fp8_transposes_ made one (opt-in, fp8_transposes.py: the weights' size again in memory,
          no transpose per call).
          No weight gradient (the base is frozen); the bias gets one when it requires grad.

Fused paths (FUSED, on by default; FLAME_FP8_FUSED=0 turns them off for an A/B): as bf16 Linears do
(flame_core.ops.linear.linear_low_rank), `Linear.forward_split` and plain LoRAs on an fp8-compute layer run as one node,
Float8ComputeLowRank: the LoRAs' rank-r products accumulate into the fp8 GEMM's bf16 output rows and into its dX
inside cuBLAS GEMMs (beta = 1), so no (N, out) delta is formed and added and dX gets no second add; a split
projection's parts (Flux's single-block linear1 as q | k | v | mlp, the double blocks' qkv) are views of the one fp8
GEMM's output, and backward takes the parts' gradients as they come into ONE quantisation (one amax over all parts,
fp8_tensor.quantize_parts_per_tensor: the same bits as quantising their concatenation) and ONE fp8 GEMM. Why one
GEMM and not dX = sum_p scaled_mm(e4m3(g_p), W_p^T) accumulated: the per-part GEMMs (K = 3072 x 3 + 12288 on linear1)
run below the whole one's rate, each after the first reads and writes dX again, and each part needs its own weight
slice transposed; the one-GEMM form only needs the parts quantised side by side, which costs what quantising any
gradient of that size costs. `Linear.forward_cat2` (Flux's single-block linear2 over attention | MLP) likewise,
Float8ComputeCat2: the two inputs quantised side by side into one e4m3 operand (no bf16 concatenation) and their
gradients from two GEMMs on W^T's row blocks (contiguous, no split of a joined gradient). The unfused path (FUSED
False) splits / adds / concatenates through the autograd graph: e.g. the Split node's backward concatenates the
parts' gradients (a bf16 copy of the whole output gradient) before quantising it.

Activation scaling: "current" by default (above). `set_fp8_scaling_(module, "delayed")` (the trainer's
`train.fp8_scaling: delayed`) gives each layer two sites, its input and its output gradient, scaled from the amaxes of
their last HISTORY calls (TransformerEngine's delayed scaling): one pass over the tensor, no grid-wide wait for this
call's amax (flame_core.kernels.fp8_tensor.quantize_delayed); a site's first call scales by its own amax; values
beyond the history's range saturate to +-448. A checkpointed region's recompute casts the input with the pair its
forward used (flame_core.checkpoint.recomputing), so the recomputed activations equal the forward's and the history
moves once per forward. A split projection's output gradient parts and forward_cat2's two inputs are one site each
(their parts side by side, one amax: quantize_parts_delayed). Which recipe is faster and how much quality it costs:
bench/step_profile.py, bench/fp8_lora_quality.py --modes bf16,fp8_compute,fp8_delayed.

Weight scales: cuBLASLt on Hopper takes one scale per operand (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER), so an fp8
compute layer holds a per-tensor scale -- stored, as fp8 storage always is, as the `weight_scale` row vector, every
entry equal. A per-channel scale cannot be applied inside the GEMM and would cost a pass over the output after it;
e4m3's rounding error is relative, so one scale for the tensor loses precision only in rows whose largest value is
~2^6 below the tensor's (they reach the subnormals). Weights already stored per row are requantised once
(dequantise, quantise per tensor: a second rounding, bounded by half an e4m3 step).
"""
import os

import numpy as np

from flame_core import as_tensor, backend
from flame_core.amp import autocast_mode as _amp
from flame_core.autograd import Function
from flame_core.autograd.grad_mode import is_grad_enabled
from flame_core.checkpoint import recomputing
from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import activations as _A
from flame_core.kernels import fp8_gelu as _G
from flame_core.kernels import fp8_tensor as _T
from flame_core.kernels import gelu_rows as _R
from flame_core.kernels import scaled_mm as _S
from flame_core.ops.linear import (
    bias_grad,
    gradient_parts,
    low_rank_backward,
    low_rank_blocks,
    low_rank_forward,
    output_parts,
)

FAST_ACCUM_FORWARD = True
FUSED = os.environ.get("FLAME_FP8_FUSED", "1") != "0"   # the fused split / LoRA paths (see the module docstring)
# Linear.forward_gelu_mlp's one node (Float8ComputeGeluMlp) where FUSED holds; FLAME_FP8_FUSED_MLP=0: the layers' own
# nodes (an A/B of the GELU-fused casts alone)
FUSED_MLP = os.environ.get("FLAME_FP8_FUSED_MLP", "1") != "0"


def _as(arr, dtype):
    return arr if arr.dtype == dtype else arr.astype(dtype)


SCALINGS = ("current", "delayed")


class Fp8Sites:
    """A layer's delayed-scaling sites (set_fp8_scaling_): its input x and its output gradient dy, each with its own
    history (flame_core.kernels.fp8_tensor.DelayedScaling), and the (scale, factor) pair its last forward used for x:
    a checkpointed region's recompute casts x with that pair again (flame_core.checkpoint.recomputing), so the
    recomputed activations are the forward's bit for bit and the history moves once per forward."""

    def __init__(self, history=_T.HISTORY):
        self.x, self.dy = _T.DelayedScaling(history), _T.DelayedScaling(history)
        self.x_last = None


_X_QUANTIZERS = {False: (_T.quantize_per_tensor, _T.quantize_with_scale, _T.quantize_delayed),
                 True: (_T.quantize_parts_per_tensor, _T.quantize_parts_with_scale, _T.quantize_parts_delayed)}


def _cast_x(sites, delayed, with_scale):
    """A layer's input cast for its fp8 GEMM through its delayed-scaling sites: `delayed(site)` records into the input
    site's history, or in a checkpointed region's recompute `with_scale(pair)` repeats the pair of the layer's last
    forward (the recomputed activations are the forward's bit for bit; the history moves once per forward)."""
    if sites.x_last is not None and recomputing():
        return with_scale(sites.x_last)
    q, s = delayed(sites.x)
    sites.x_last = s
    return q, s


def _quantize_x(a, sites):
    """A layer's input (an array, or a list of column parts) for the fp8 GEMM: current scaling without sites, else
    _cast_x."""
    current, with_scale, delayed = _X_QUANTIZERS[isinstance(a, list)]
    if sites is None:
        return current(a)
    return _cast_x(sites, lambda site: delayed(a, site), lambda pair: with_scale(a, pair))


def _quantize_dy(g, sites):
    return _T.quantize_per_tensor(g) if sites is None else _T.quantize_delayed(g, sites.dy)


def _quantize_dy_parts(parts, sites):
    return _T.quantize_parts_per_tensor(parts) if sites is None else _T.quantize_parts_delayed(parts, sites.dy)


class Float8ComputeLinear(Function):
    """y = x @ (q * s_w)^T + b through the fp8 GEMM; see the module docstring. x is in the compute dtype `dtype`;
    `scales` (out,) all equal (a per-tensor weight scale). No double backward."""

    @staticmethod
    def forward(ctx, x, q, scales, b, dtype, sites=None, wt=None):
        a = x.array
        qx, sx = _quantize_x(a.reshape(-1, a.shape[-1]), sites)
        bias = _as(b.array, dtype) if b is not None else None
        y = _S.scaled_mm(qx, q.array, sx, scales.array, bias=bias, out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(q, scales)
        ctx.x_shape, ctx.dtype, ctx.sites, ctx.wt = x.shape, dtype, sites, wt
        return as_tensor(y.reshape(tuple(x.shape[:-1]) + (q.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        need = ctx.needs_input_grad
        nx, nb = need[0], need[3]
        g2 = g.reshape(-1, g.shape[-1])
        dx = db = None
        if nx:
            from .fp8_transposes import weight_transposed
            q, scales = ctx.saved_tensors
            ga = g2.array if g2.array.dtype.itemsize <= 4 else g2.array.astype(ctx.dtype)   # float64: no kernel
            qg, sg = _quantize_dy(ga, ctx.sites)   # bf16 / fp16 / fp32 alike: the kernel reads each
            wt = weight_transposed(q, ctx.wt)      # (in, out): K-major for dX = dY @ W
            dx = _S.scaled_mm(qg, wt, sg, scales.array, out_dtype=ctx.dtype)
            dx = as_tensor(dx.reshape(tuple(ctx.x_shape)))
        if nb:
            db = g2.sum(0)
        return dx, None, None, db, None, None, None


class Float8ComputeLowRank(Function):
    """Float8ComputeLinear plus low-rank updates of output-row blocks, and / or its output as column-block views, as
    one node (the fp8-compute form of flame_core.ops.linear.LinearLowRank; see the module docstring):

        y = scaled_mm(e4m3(x), W_q) + b;   y[..., lo_i:hi_i] += s_i (x A_i^T) B_i^T      (x unquantised, dtype)
        dx = scaled_mm(e4m3([g_1 | g_2 | ...]), W_q^T) + sum_i s_i (g_i B_i) A_i

    Inputs: x, q, scales, b, then A_1, B_1, ...; `blocks` ((lo, hi, s), ...), `splits` (sizes) or None; `wt` the
    layer's resident W^T (fp8_transposes.TransposedWeight) or None. The factors
    are in the compute dtype `dtype`, as x. Saved: x and the (N, sum r) x A_i^T when a factor trains, the fp8 weight
    when x needs its gradient. No double backward."""

    @staticmethod
    def forward(ctx, x, q, scales, b, dtype, blocks, splits, sites, wt, *factors):
        a = x.array.reshape(-1, x.shape[-1])
        qx, sx = _quantize_x(a, sites)
        bias = _as(b.array, dtype) if b is not None else None
        y = _S.scaled_mm(qx, q.array, sx, scales.array, bias=bias, out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        h = low_rank_forward(a, y, [f.array for f in factors], blocks)
        need = ctx.needs_input_grad
        train = any(need[9:])
        ctx.save_for_backward(x if train else None, q if need[0] else None, scales if need[0] else None, *factors)
        ctx.h = h if train else None
        ctx.blocks, ctx.splits, ctx.x_shape, ctx.dtype = blocks, splits, tuple(x.shape), np.dtype(dtype)
        ctx.sites, ctx.wt = sites, wt
        return output_parts(y, x.shape[:-1], splits)

    @staticmethod
    def backward(ctx, *gs):
        if is_grad_enabled():
            raise RuntimeError("fp8 compute: double backward (create_graph=True) is not supported")
        x, q, scales, *factors = ctx.saved_tensors
        need = ctx.needs_input_grad
        dt = ctx.dtype
        parts, n_out = gradient_parts(gs, ctx.splits)
        parts = [(lo, gd if gd.dtype == dt else gd.astype(dt)) for lo, gd in parts]   # e.g. float64 from a test
        rows = int(np.prod(ctx.x_shape[:-1]))
        dx = None
        if need[0]:
            xp = backend.xp_of(q.array)
            if parts:
                cols, lo = [], 0
                for p0, gd in parts:                 # the output gradient's column blocks, zeros where none came
                    if p0 > lo:
                        cols.append(xp.zeros((rows, p0 - lo), dtype=dt))
                    cols.append(gd)
                    lo = p0 + gd.shape[1]
                if lo < n_out:
                    cols.append(xp.zeros((rows, n_out - lo), dtype=dt))
                from .fp8_transposes import weight_transposed
                qg, sg = _quantize_dy_parts(cols, ctx.sites)   # the parts side by side: one amax / one site
                dx = _S.scaled_mm(qg, weight_transposed(q, ctx.wt), sg, scales.array, out_dtype=dt)
            else:
                dx = xp.zeros((rows, ctx.x_shape[-1]), dtype=dt)
        xd = None if x is None else x.array.reshape(-1, x.shape[-1])
        grads = low_rank_backward(parts, xd, dx, [f.array for f in factors], ctx.blocks, ctx.h, need[9:])
        dbias = None
        if need[3]:
            dbias = as_tensor(bias_grad(parts, n_out, dt, backend.xp_of(q.array)))
        dx = as_tensor(dx.reshape(ctx.x_shape)) if need[0] else None
        return (dx, None, None, dbias, None, None, None, None, None,
                *(None if g is None else as_tensor(g) for g in grads))


def fp8_linear_low_rank(input, q, scales, bias, dtype, factors, splits=None, sites=None, wt=None):
    """The fp8-compute Linear (q e4m3 (out, in), scales its per-tensor scale) with low-rank updates `factors`
    [(A, B, lo, hi, scale)] and / or `splits`, as Float8ComputeLowRank; input and bias in the compute dtype `dtype`
    (the caller's checks), the factors cast to it under autocast (as linear_low_rank), else of that dtype."""
    ab = [t for f in factors for t in f[:2]]
    if _amp.active and ab:
        ab = list(_amp.cast_inputs("lower", *ab))
    blocks, splits = low_rank_blocks("fp8 linear", factors, ab, tuple(q.shape), splits)
    if any(t.dtype.np != np.dtype(dtype) for t in ab):
        raise DTypeError(f"fp8 linear: the low-rank factors must have the compute dtype {np.dtype(dtype)}, got "
                         f"{sorted({str(t.dtype) for t in ab})} (cast them, or use flame.amp.autocast)")
    return Float8ComputeLowRank.apply(input, q, scales, bias, np.dtype(dtype), blocks, splits, sites, wt, *ab)


class Float8ComputeCat2(Function):
    """Float8ComputeLinear of cat((a, b), -1) without the bf16 concatenation (Flux's single-block linear2 over
    attention | MLP): a and b quantised side by side into one e4m3 operand with one amax (the same bits as
    quantising the concatenation), one fp8 GEMM; backward: the output gradient quantised once and two fp8 GEMMs on
    the row blocks of W^T, so da and db come out as separate contiguous arrays (no split of a joined gradient)."""

    @staticmethod
    def forward(ctx, a, b, q, scales, bias, dtype, sites=None, wt=None):
        a2, b2 = a.array.reshape(-1, a.shape[-1]), b.array.reshape(-1, b.shape[-1])
        qx, sx = _quantize_x([a2, b2], sites)
        y = _S.scaled_mm(qx, q.array, sx, scales.array, bias=None if bias is None else _as(bias.array, dtype),
                         out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ctx.save_for_backward(q, scales)
        ctx.shapes, ctx.dtype, ctx.sites, ctx.wt = (tuple(a.shape), tuple(b.shape)), np.dtype(dtype), sites, wt
        return as_tensor(y.reshape(tuple(a.shape[:-1]) + (q.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        need = ctx.needs_input_grad
        da, db, dbias = _cat2_backward(ctx, g, ctx.saved_tensors[:2], need[0], need[1], need[4])
        (sa, sb) = ctx.shapes
        return (None if da is None else as_tensor(da.reshape(sa)), None if db is None else as_tensor(db.reshape(sb)),
                None, None, dbias, None, None, None)


def _cat2_backward(ctx, g, saved, na, nb, nbias):
    """(da, db, dbias) of y = scaled_mm(e4m3([a | b]), W_q) + bias (ctx: shapes, dtype, sites, wt; saved: q, scales):
    the output gradient quantised once, da and db (2-D arrays, None where not wanted) from two fp8 GEMMs on W^T's row
    blocks, the bias gradient a Tensor."""
    dt = ctx.dtype
    g2 = g.reshape(-1, g.shape[-1])
    da = db = dbias = None
    if na or nb:
        from .fp8_transposes import weight_transposed
        q, scales = saved
        ga = g2.array if g2.array.dtype.itemsize <= 4 else g2.array.astype(dt)   # float64: no kernel
        qg, sg = _quantize_dy(ga, ctx.sites)
        wt = weight_transposed(q, ctx.wt)              # (in, out); both GEMMs enqueued before its next use
        ha = ctx.shapes[0][-1]
        if na:
            da = _S.scaled_mm(qg, wt[:ha], sg, scales.array, out_dtype=dt)
        if nb:
            db = _S.scaled_mm(qg, wt[ha:], sg, scales.array, out_dtype=dt)
    if nbias:
        dbias = g2.sum(0)
    return da, db, dbias


def fp8_linear_cat2(a, b, q, scales, bias, dtype, sites=None, wt=None):
    """The fp8-compute Linear (q e4m3 (out, in), scales its per-tensor scale) of cat((a, b), -1), as
    Float8ComputeCat2; a, b and bias in the compute dtype `dtype` (the caller's checks)."""
    if a.shape[:-1] != b.shape[:-1] or a.shape[-1] + b.shape[-1] != q.shape[1]:
        raise ShapeError(f"fp8 linear_cat2: inputs {tuple(a.shape)} and {tuple(b.shape)} do not fit a weight of "
                         f"shape {tuple(q.shape)}")
    return Float8ComputeCat2.apply(a, b, q, scales, bias, np.dtype(dtype), sites, wt)


class Float8ComputeGeluMlp(Function):
    """fc2(gelu(fc1(x))) for two fp8-compute Linears with delayed scaling, as one node (Linear.forward_gelu_mlp):

        h = scaled_mm(e4m3(x), W1_q) + b1                    (compute dtype, kept for the backward)
        y = scaled_mm(e4m3(gelu(h)), W2_q) + b2              gelu and fc2's input cast: one kernel (fp8_gelu)
        dg = scaled_mm(e4m3(dy), W2_q^T)
        dx = scaled_mm(e4m3(dg * gelu'(h)), W1_q^T)          gelu's backward and fc1's gradient cast: one kernel

    The composed layers' numbers (each layer's own sites, the same roundings), without writing gelu(h) or its
    gradient in the compute dtype and reading them back to quantise: 4 bytes an element of the MLP's width fewer
    each way. Inputs: x, q1, scales1, b1, q2, scales2, b2; the biases must not train (the caller's condition: a frozen
    base); `wts` the layers' resident W^T or None. No double backward."""

    @staticmethod
    def forward(ctx, x, q1, s1, b1, q2, s2, b2, dtype, approximate, sites, wts):
        a = x.array.reshape(-1, x.shape[-1])
        qx, sx = _quantize_x(a, sites[0])
        h = _S.scaled_mm(qx, q1.array, sx, s1.array, bias=None if b1 is None else _as(b1.array, dtype),
                         out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        qg, sg = _cast_x(sites[1], lambda site: _G.gelu_quantize_delayed(h, site, approximate),   # fc2's input
                         lambda pair: _G.gelu_quantize_with_scale(h, pair, approximate))
        y = _S.scaled_mm(qg, q2.array, sg, s2.array, bias=None if b2 is None else _as(b2.array, dtype),
                         out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(q1, s1, q2, s2)
            ctx.h = h
        ctx.x_shape, ctx.dtype, ctx.approximate, ctx.sites, ctx.wts = tuple(x.shape), np.dtype(dtype), approximate, \
            sites, wts
        return as_tensor(y.reshape(ctx.x_shape[:-1] + (q2.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return (None,) * 11
        if is_grad_enabled():
            raise RuntimeError("fp8 compute: double backward (create_graph=True) is not supported")
        from .fp8_transposes import weight_transposed
        q1, s1, q2, s2 = ctx.saved_tensors
        dt, (sites1, sites2), (wt1, wt2) = ctx.dtype, ctx.sites, ctx.wts
        ga = g.array.reshape(-1, g.shape[-1])
        qdy, sdy = _quantize_dy(_as(ga, dt), sites2)
        dg = _S.scaled_mm(qdy, weight_transposed(q2, wt2), sdy, s2.array, out_dtype=dt)
        qdh, sdh = _G.gelu_grad_quantize_delayed(dg, ctx.h, sites1.dy, ctx.approximate)
        ctx.h = dg = None     # both freed before fc1's dX is allocated
        dx = _S.scaled_mm(qdh, weight_transposed(q1, wt1), sdh, s1.array, out_dtype=dt)
        return (as_tensor(dx.reshape(ctx.x_shape)),) + (None,) * 10


def fp8_gelu_mlp(x, fc1, fc2, dtype, approximate, biases):
    """fc2(gelu(fc1(x))) as Float8ComputeGeluMlp for two fp8-compute Linears with delayed-scaling sites (the caller's
    checks: Float8LinearMixin.fused_gelu_mlp); x and `biases` (b1, b2) in the compute dtype `dtype`."""
    if x.shape[-1] != fc1.weight.shape[1] or fc1.weight.shape[0] != fc2.weight.shape[1]:
        raise ShapeError(f"fp8 gelu mlp: input {tuple(x.shape)}, fc1 weight {tuple(fc1.weight.shape)} and fc2 weight "
                         f"{tuple(fc2.weight.shape)} do not fit")
    d1, d2 = fc1.__dict__, fc2.__dict__
    return Float8ComputeGeluMlp.apply(x, fc1.weight, fc1.weight_scale, biases[0], fc2.weight, fc2.weight_scale,
                                      biases[1], np.dtype(dtype), approximate, (d1["_fp8_sites"], d2["_fp8_sites"]),
                                      (d1.get("_fp8_wt"), d2.get("_fp8_wt")))


class Float8ComputeCat2Gelu(Function):
    """Float8ComputeCat2 of (a, gelu(h)) -- Flux's single-block linear2 over attention | GELU(MLP) -- with the GELU
    in the cast (fp8_gelu.cat_gelu_quantize_delayed: a and gelu(h) quantised side by side from a and h as they are,
    h read in place from linear1's output): gelu(h) is never written in the compute dtype. Backward: the output
    gradient quantised once, two fp8 GEMMs on W^T's row blocks (da, and d gelu(h)), then GELU's backward into the
    latter. Delayed scaling only (the site's factor is known before the cast). No double backward."""

    @staticmethod
    def forward(ctx, a, h, q, scales, bias, dtype, sites, wt, approximate):
        a2, h2 = a.array.reshape(-1, a.shape[-1]), h.array.reshape(-1, h.shape[-1])
        qx, sx = _cast_x(sites, lambda site: _G.cat_gelu_quantize_delayed(a2, h2, site, approximate),
                         lambda pair: _G.cat_gelu_quantize_with_scale(a2, h2, pair, approximate))
        y = _S.scaled_mm(qx, q.array, sx, scales.array, bias=None if bias is None else _as(bias.array, dtype),
                         out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        need = ctx.needs_input_grad
        if need[0] or need[1]:
            ctx.save_for_backward(q, scales, h if need[1] else None)
        ctx.shapes, ctx.dtype, ctx.sites, ctx.wt = (tuple(a.shape), tuple(h.shape)), np.dtype(dtype), sites, wt
        ctx.approximate = approximate
        return as_tensor(y.reshape(tuple(a.shape[:-1]) + (q.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        need = ctx.needs_input_grad
        if (need[0] or need[1]) and is_grad_enabled():
            raise RuntimeError("fp8 compute: double backward (create_graph=True) is not supported")
        q, scales, h = ctx.saved_tensors
        da, dgl, dbias = _cat2_backward(ctx, g, (q, scales), need[0], need[1], need[4])   # dgl: d gelu(h)
        (sa, sh) = ctx.shapes
        dh = None
        if dgl is not None:   # GELU's backward written over dgl, h's rows read in place (tanh: gelu_rows)
            h2 = h.array.reshape(-1, sh[-1])
            dh = (_R.gelu_tanh_rows_backward(dgl, h2, out=dgl) if ctx.approximate == "tanh"
                  else _A.gelu_backward(dgl, h2, "none", out=dgl))
            dh = as_tensor(dh.reshape(sh))
        return None if da is None else as_tensor(da.reshape(sa)), dh, None, None, dbias, None, None, None, None


def fp8_linear_cat2_gelu(a, h, q, scales, bias, dtype, sites, wt, approximate):
    """The fp8-compute Linear (q e4m3 (out, in), scales its per-tensor scale) of cat((a, gelu(h)), -1), as
    Float8ComputeCat2Gelu; a, h and bias in the compute dtype `dtype` (the caller's checks), `sites` delayed."""
    if a.shape[:-1] != h.shape[:-1] or a.shape[-1] + h.shape[-1] != q.shape[1]:
        raise ShapeError(f"fp8 linear_cat2_gelu: inputs {tuple(a.shape)} and {tuple(h.shape)} do not fit a weight of "
                         f"shape {tuple(q.shape)}")
    return Float8ComputeCat2Gelu.apply(a, h, q, scales, bias, np.dtype(dtype), sites, wt, approximate)
