"""bf16 matmul of any rank on cuda through cuBLAS `gemmStridedBatchedEx` (fp32 accumulation).

CuPy 14 multiplies bf16 matrices only in 2-D; FLAME needs batched and broadcast products (attention scores, linear
layers on (B, L, H) activations). Operands are passed without copies whenever each matrix is row- or column-major
and the batch dims collapse into one stride (stride 0 for a broadcast operand); anything else is made contiguous.
"""
import numpy as np

from .. import backend
from .. import dtypes as D

BF16 = np.dtype(D.bfloat16.np)
_ONE = np.array(1.0, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)
OP_N, OP_T = 0, 1


def _batch_stride(x, nbatch):
    """One element stride for the leading `nbatch` dims of x, or None if they don't collapse."""
    if nbatch == 0:
        return 0
    item = x.itemsize
    shape, strides = x.shape[:nbatch], [s // item for s in x.strides[:nbatch]]
    live = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not live:
        return 0
    if all(s == 0 for _, s in live):
        return 0
    for (n0, s0), (n1, s1) in zip(live, live[1:]):
        if s0 != s1 * n1:
            return None
    return live[-1][1]


def _layout(x):
    """(op, ld) describing x's trailing (R, C) matrices in cuBLAS terms, or None if neither row- nor column-major."""
    R, C = x.shape[-2:]
    item = x.itemsize
    s_r, s_c = x.strides[-2] // item, x.strides[-1] // item
    if (s_c == 1 or C == 1) and s_r >= max(C, 1):
        return OP_N, max(s_r, C, 1)
    if (s_r == 1 or R == 1) and s_c >= max(R, 1):
        return OP_T, max(s_c, R, 1)
    return None


def _prepare(x, nbatch):
    cp = backend.cupy
    lay = _layout(x)
    bs = _batch_stride(x, nbatch)
    if lay is None or bs is None:
        x = cp.ascontiguousarray(x)
        lay, bs = _layout(x), _batch_stride(x, nbatch)
    return x, lay[0], lay[1], bs


def matmul_bf16(a, b):
    """a @ b for cupy bf16 arrays with NumPy matmul semantics (1-D promotion, batch broadcasting)."""
    cp = backend.cupy
    if b.ndim == 1:
        return matmul_bf16(a, b[:, None])[..., 0]
    if a.ndim == 1:
        return matmul_bf16(a[None, :], b)[..., 0, :]
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    out = cp.empty(batch + (M, N), dtype=BF16)
    if out.size == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    nb = len(batch)
    A, opA, lda, sA = _prepare(cp.broadcast_to(a, batch + (M, K)), nb)
    B, opB, ldb, sB = _prepare(cp.broadcast_to(b, batch + (K, N)), nb)
    count = int(np.prod(batch)) if batch else 1
    from cupy.cuda import cublas, device, runtime
    handle = device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)  # CuPy sets it per call too; a graph needs it
    mode = cublas.getPointerMode(handle)
    if mode != cublas.CUBLAS_POINTER_MODE_HOST:
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        # row-major C = A @ B  <=>  column-major C^T = B^T A^T: B's memory is the first operand
        cublas.gemmStridedBatchedEx(
            handle, opB, opA, N, M, K, _ONE.ctypes.data,
            B.data.ptr, runtime.CUDA_R_16BF, ldb, sB,
            A.data.ptr, runtime.CUDA_R_16BF, lda, sA,
            _ZERO.ctypes.data, out.data.ptr, runtime.CUDA_R_16BF, N, M * N,
            count, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        if mode != cublas.CUBLAS_POINTER_MODE_HOST:
            cublas.setPointerMode(handle, mode)
    return out
