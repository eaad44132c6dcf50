"""Per-row fp8 (float8_e4m3fn) quantization of Tensors (flame_core.kernels.fp8): one byte per value and one fp32
scale per row (the last axis is the row). A storage format, not differentiable. fp8 Tensors follow the core's
convention: ml_dtypes float8 arrays on cpu, raw bytes in a uint8 array flagged `_f8` on cuda."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import DTypeError
from ..kernels import fp8 as K
from ..kernels import fp8_tensor as KT
from ..tensor import _wrap


def _as_fp8_tensor(q_bytes):
    if backend.is_cuda_array(q_bytes):
        t = _wrap(q_bytes)
        t._f8 = True
        return t
    return _wrap(q_bytes.view(D.float8_e4m3fn.np))


def quantize_fp8(x, per_tensor=False):
    """-> (q, scales): q float8_e4m3fn of x's shape, scales float32 of shape x.shape[:-1]; x ~= q * scale.
    per_tensor: one scale for the whole tensor (amax(|x|) / 448), repeated in every entry of `scales` -- the operand
    format of the fp8 GEMM, which takes one scale per operand."""
    if not x.dtype.is_floating_point or x.dtype is D.float8_e4m3fn:
        raise DTypeError(f"quantize_fp8: expects a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    data = x.detach()._data
    if not per_tensor:
        q, scales = K.quantize_per_row(data)
        return _as_fp8_tensor(q), _wrap(scales)
    if data.dtype == np.float64:
        data = data.astype(np.float32)
    q, s = KT.quantize_per_tensor(data)
    return _as_fp8_tensor(q), _wrap(backend.xp_of(s).broadcast_to(s[:1], data.shape[:-1]).copy())


def requantize_fp8_per_tensor(q, scales):
    """(q, scales) of fp8 values with row scales turned into one scale per tensor (quantize_fp8(per_tensor=True)'s
    format): dequantised in float32 and quantised again -- a second rounding, at most half an e4m3 step. Returned
    unchanged when every scale is already equal."""
    s = scales._data
    if s.size == 0 or bool((s == s.reshape(-1)[0]).all()):
        return q, scales
    return quantize_fp8(dequantize_fp8(q, scales, D.float32), per_tensor=True)


def dequantize_fp8(q, scales, dtype=None):
    """q * scale per row, in `dtype` (default float32)."""
    if q.dtype is not D.float8_e4m3fn:
        raise DTypeError(f"dequantize_fp8: q must be float8_e4m3fn, got {q.dtype}")
    dt = D.dtype(dtype) if dtype is not None else D.float32
    return _wrap(K.dequantize_per_row(q._data.view(np.uint8), scales._data, dt.np))
