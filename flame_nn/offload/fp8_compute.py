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
          weight, cheaper than the bf16 path's dequantisation, which writes 2): no second weight copy stays resident.
          No weight gradient (the base is frozen); the bias gets one when it requires grad.

Weight scales: cuBLASLt on Hopper takes one scale per operand (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER), so an fp8
compute layer holds a per-tensor scale -- stored, as fp8 storage always is, as the `weight_scale` row vector, every
entry equal. A per-channel scale cannot be applied inside the GEMM and would cost a pass over the output after it;
e4m3's rounding error is relative, so one scale for the tensor loses precision only in rows whose largest value is
~2^6 below the tensor's (they reach the subnormals). Weights already stored per row are requantised once
(dequantise, quantise per tensor: a second rounding, bounded by half an e4m3 step).
"""
from flame_core import as_tensor
from flame_core.autograd import Function
from flame_core.kernels import fp8_tensor as _T
from flame_core.kernels import scaled_mm as _S

FAST_ACCUM_FORWARD = True


def _as(arr, dtype):
    return arr if arr.dtype == dtype else arr.astype(dtype)


class Float8ComputeLinear(Function):
    """y = x @ (q * s_w)^T + b through the fp8 GEMM; see the module docstring. x is in the compute dtype `dtype`;
    `scales` (out,) all equal (a per-tensor weight scale). No double backward."""

    @staticmethod
    def forward(ctx, x, q, scales, b, dtype):
        a = x.array
        qx, sx = _T.quantize_per_tensor(a.reshape(-1, a.shape[-1]))
        bias = _as(b.array, dtype) if b is not None else None
        y = _S.scaled_mm(qx, q.array, sx, scales.array, bias=bias, out_dtype=dtype, fast_accum=FAST_ACCUM_FORWARD)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(q, scales)
        ctx.x_shape, ctx.dtype = x.shape, dtype
        return as_tensor(y.reshape(tuple(x.shape[:-1]) + (q.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        nx, _, _, nb, _ = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        dx = db = None
        if nx:
            from .fp8 import transposed_into_scratch
            q, scales = ctx.saved_tensors
            ga = g2.array if g2.array.dtype.itemsize <= 4 else g2.array.astype(ctx.dtype)   # float64: no kernel
            qg, sg = _T.quantize_per_tensor(ga)   # bf16 / fp16 / fp32 alike: the kernel reads each
            wt = transposed_into_scratch(q.array)   # (in, out): K-major for dX = dY @ W
            dx = _S.scaled_mm(qg, wt, sg, scales.array, out_dtype=ctx.dtype)
            dx = as_tensor(dx.reshape(tuple(ctx.x_shape)))
        if nb:
            db = g2.sum(0)
        return dx, None, None, db, None
