"""Deterministic column sums of fp32 partial rows (the second pass of the norm / modulation backwards), and the
zeroed counters of the kernels that sum their partial rows in the same launch."""
import numpy as np

from .. import backend
from . import launching as KL
from . import loader as L
from . import plans as P

column_sum_rows = 32  # threads per column in column_sum's blocks of (32, column_sum_rows) (1 .. 32)
# The 16-byte form (common.cuh, column_sum_vec4) where cols % 4 == 0: blocks of (4, column_sum_vec_rows), 16 columns
# each (a multiple of 8, <= 256). 0: always the scalar form. By default ("auto") only where the scalar form's blocks
# (1024 threads at 40 registers: one per SM) would not all fit at once (LayerNorm's two batches of 3072 columns:
# 192 blocks on 132 SMs: that whole backward went from 0.0390-0.0403 to 0.0376-0.0390 ms on the H100); "always"
# for the tests.
column_sum_vec_rows = 128
column_sum_vec_when = "auto"


def column_sum(stem, kernel, part, out_dtype, dependent=False):
    """Deterministic sums over axis -2 of fp32 partial rows: (parts, cols) -> (cols,) or (B, parts, cols) -> (B, cols),
    by `kernel` (a `column_sum_body` wrapper in cuda_src/<stem>.cu), in out_dtype. dependent: launched as a
    programmatic dependent of the kernel that wrote `part` (launch_dependent), which must be the stream's last."""
    xp = backend.xp_of(part)
    batches = part.shape[0] if part.ndim == 3 else 1
    parts, cols = part.shape[-2:]
    kdt = out_dtype if L.dtype_name(out_dtype) in ("float32", "float16", "bfloat16") else np.float32
    out = xp.empty(part.shape[:-2] + (cols,), dtype=kdt)
    wide = column_sum_vec_when == "always" or P.cdiv(cols, 32) * batches > P.sm_count()
    if column_sum_vec_rows and wide and cols % 4 == 0 and part.data.ptr % 16 == 0:
        grid, block = (P.cdiv(cols, 16), batches), (4, column_sum_vec_rows)
    else:
        grid, block = (P.cdiv(cols, 32), batches), (32, column_sum_rows)
    (KL.launch_dependent if dependent else KL.launch)(L.get_function(stem, kernel, kdt), grid, block,
                                                      (part, out, KL.i32(parts), KL.i32(cols)))
    return out.astype(out_dtype, copy=False)


_counters = {}  # (device, stream) -> zeroed uint32 counters of the single-launch column sums


def reduction_counters(n):
    """A uint32 device buffer of >= n zeroed counters for kernels that sum their partial rows in the same launch
    (common.cuh, last_arrival: the last block to arrive resets each counter it used, so the buffer is zero again when
    the kernel ends). Eager launches share one persistent buffer per (device, stream): launches on one stream run in
    order, and concurrent streams get their own. While a CUDA graph is being captured: a fresh buffer from the pool
    (the graph's private memory) zeroed by an async memset, captured with the kernel and replayed before it."""
    cp = backend.cupy
    s = cp.cuda.get_current_stream()
    if s.ptr and s.is_capturing():
        buf = cp.empty((max(1, n),), dtype=np.uint32)
        cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, s.ptr)
        return buf
    key = (cp.cuda.runtime.getDevice(), s.ptr)
    buf = _counters.get(key)
    if buf is None or buf.size < n:
        buf = _counters[key] = cp.zeros((max(1024, n),), dtype=np.uint32)  # zeroed in order on this stream
    return buf
