"""Matrix products on cuda straight through cuBLAS (`cublasGemmEx` / `cublasGemmStridedBatchedEx`), any rank.

Why not cupy.matmul: it multiplies bf16 only in 2-D, costs ~35 µs of host time per call, and refuses to run while
a CUDA graph is being captured (CuPy's cuBLAS wrapper raises). FLAME calls the C functions of the libcublas CuPy
already loaded, through ctypes, on a cuBLAS handle of its own per thread and device (nothing else calls cuBLAS on
it): its pointer mode stays host (cuBLAS's default), and its stream is set only when the current CuPy stream is not
the one it was last set to -- then its workspace, a block of FLAME's pool, is set again too, since cublasSetStream
resets the workspace to cuBLAS's own pool (with FLAME's, cuBLAS allocates nothing itself, which graph capture
requires). An eager call thus makes one cuBLAS call, not three (CuPy's shared handle needed the stream and pointer
mode set at every call, as CuPy's own calls change them).

Operands are passed without copies whenever each matrix is row- or column-major and the batch dims collapse into
one stride (stride 0 for a broadcast operand); anything else is made contiguous. float32 runs in float32 (no TF32,
as cupy.matmul); float16 / bfloat16 accumulate in float32 and round once.
"""
import ctypes
import math
import sys
import threading

import numpy as np

from .. import backend
from .. import dtypes as D
from ..memory import recycle

BF16 = np.dtype(D.bfloat16.np)
OP_N, OP_T = 0, 1
_CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, BF16: 14}  # cudaDataType
_COMPUTE_32F = 68                                                          # CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ONE_REF, _ZERO_REF = ctypes.byref(_ONE), ctypes.byref(_ZERO)
_lib = None
_local = threading.local()   # .handles: {device id: _Handle} of this thread
_live = set()                # the pointers of FLAME's handles not destroyed (live_handles())
_nd = backend._cupy_ndarray if backend.cupy is not None else None
_rc_on, _rc_take, _RC_MAX = recycle.on, recycle.take, recycle.MAX_NUMEL
_FLAGS = _nd is not None and hasattr(_nd, "_c_contiguous")   # CuPy's internal contiguity flags (else .flags)
_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None
_get_stream = backend.cupy.cuda.get_current_stream if backend.cupy is not None else None


class _Handle:
    """A cuBLAS handle of FLAME's (one per thread and device), the stream it is set to and its workspace. It is
    destroyed when its thread ends (the thread's `_local` goes, and with it this object): a thread-per-task program
    does not pile up handles and cuBLAS's device memory for them."""
    __slots__ = ("ptr", "stream", "workspace", "device", "__weakref__")

    def __init__(self, lib, device):
        cp = backend.cupy
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "Create")
        self.ptr = h.value
        self.device = device
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self.stream = None
        _live.add(self.ptr)

    def close(self):
        """cublasDestroy (it synchronizes the device first, so the workspace is idle when it goes back to the pool)."""
        if self.ptr is None:
            return
        with backend.cupy.cuda.Device(self.device):
            _check(_lib.cublasDestroy_v2(self.ptr), "Destroy")
        _live.discard(self.ptr)
        self.ptr = None

    def __del__(self):
        if self.ptr is not None and _lib is not None and not sys.is_finalizing():
            try:
                self.close()
            except Exception:   # a destructor cannot raise (e.g. the CUDA context already torn down)
                pass

    def set_stream(self, lib, stream):
        _check(lib.cublasSetStream_v2(self.ptr, stream), "SetStream")
        # cublasSetStream resets the workspace to cuBLAS's own pool: FLAME's again
        _check(lib.cublasSetWorkspace_v2(self.ptr, self.workspace.data.ptr, WORKSPACE_BYTES), "SetWorkspace")
        self.stream = stream


def supported(dtype):
    return np.dtype(dtype) in _CUDA_TYPE


def loaded_library(soname):
    """ctypes.CDLL of the shared library `soname` (e.g. "libcublas.so") this process already mapped (the one CuPy
    loaded, found in /proc/self/maps), else the loader's own pick."""
    path = None
    with open("/proc/self/maps") as f:
        for line in f:
            name = line.rsplit(None, 1)[-1]
            if f"/{soname}" in name:
                path = name
                break
    return ctypes.CDLL(path or soname, mode=ctypes.RTLD_GLOBAL)


def _libcublas():
    """The libcublas CuPy uses (found in this process's mappings), with the signatures FLAME calls."""
    global _lib
    if _lib is not None:
        return _lib
    from cupy.cuda import device  # noqa: F401 - makes CuPy load its cuBLAS
    device.get_cublas_handle()
    lib = loaded_library("libcublas.so")
    vp, i, ll, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, sz]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    for fn in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
               lib.cublasGemmEx, lib.cublasGemmStridedBatchedEx):
        fn.restype = ctypes.c_int
    _lib = lib
    return lib


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} failed with status {status}")


def _state():
    """This thread's _Handle on the current device (made at its first use)."""
    cp = backend.cupy
    dev = cp.cuda.runtime.getDevice()
    try:
        return _local.handles[dev]
    except AttributeError:
        _local.handles = {}
    except KeyError:
        pass
    st = _local.handles[dev] = _Handle(_libcublas(), dev)
    return st


def _handle():
    """(libcublas, FLAME's cuBLAS handle of this thread and device, set to the current CuPy stream)."""
    st = _state()
    stream = backend.cupy.cuda.get_current_stream().ptr
    if st.stream != stream:
        st.set_stream(_lib, stream)
    return _lib, st.ptr


def live_handles():
    """How many of FLAME's cuBLAS handles exist, i.e. were created and not (successfully) destroyed: one per thread
    and device that ran a product; a thread's go when it ends."""
    return len(_live)


def workspace():
    """The workspace of this thread's cuBLAS handle on the current device (allocated with it). cuBLASLt's calls
    (gemm_lt, scaled_mm) use it too: calls on a stream run one after another, so one workspace serves both libraries,
    as in PyTorch (32 MiB of the pool instead of 64)."""
    return _state().workspace


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


def new_output(shape, numel, dtype):
    """A new C-contiguous cupy array for a product's output: a small one (numel within the bin's bound) from the bin
    of small dead arrays when it holds one of this shape (memory.recycle), else a new array from the pool."""
    out = _rc_take(shape, dtype) if _rc_on[0] and numel <= _RC_MAX else None
    return _nd(shape, dtype) if out is None else out


def _prepare_2d(x):
    """_prepare(x, 0) of a 2-D array, read off its contiguity flags where they decide it."""
    if _FLAGS:
        c, f = x._c_contiguous, x._f_contiguous
    else:
        fl = x.flags
        c, f = fl.c_contiguous, fl.f_contiguous
    if c:
        return x, OP_N, max(x.shape[1], 1), 0
    if f:
        return x, OP_T, max(x.shape[0], 1), 0
    return _prepare(x, 0)


def _out_layout(out, shape, dtype):
    """ldc of a caller-given output: (M, N) with unit column stride and row stride >= N (a column block of a wider
    matrix is fine); batched outputs must be contiguous."""
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"matmul: out has shape {out.shape} / {out.dtype}, expected {shape} / {dtype}")
    item = out.itemsize
    if len(shape) == 2 and out.strides[1] == item and out.strides[0] // item >= shape[1]:
        return out.strides[0] // item
    if out.flags.c_contiguous:
        return shape[-1]
    raise ValueError(f"matmul: out must be row-major (strides {out.strides})")


def matmul(a, b, out=None, beta=0.0, alpha=1.0):
    """alpha * (a @ b) for cupy float32/float16/bfloat16 arrays of one dtype, NumPy matmul semantics (1-D promotion,
    batch broadcasting). With `out` (2-D: any row stride; batched: contiguous) the product is written there, scaled
    sums included: out = alpha * (a @ b) + beta * out (beta=1 accumulates); `out` may be float32 for float16 /
    bfloat16 operands (the fp32 accumulator is then stored as it is: sums over several products lose nothing to
    rounding)."""
    if out is None and beta == 0.0 and a.ndim == 2 and b.ndim == 2:
        # the eager per-op path (every linear's backward, x @ W): 2-D operands, each row- or column-major, a new
        # output; the checks and the handle read inline (the general path below handles everything else)
        M, K = a.shape
        N = b.shape[1]
        if b.shape[0] == K and M and N and K:
            if _FLAGS:
                ac, af, bc, bf = a._c_contiguous, a._f_contiguous, b._c_contiguous, b._f_contiguous
            else:
                ac, af, bc, bf = a.flags.c_contiguous, a.flags.f_contiguous, b.flags.c_contiguous, b.flags.f_contiguous
            if (ac or af) and (bc or bf):
                dt = a.dtype
                t = _CUDA_TYPE[dt]
                out = _rc_take((M, N), dt) if _rc_on[0] and M * N <= _RC_MAX else None
                if out is None:
                    out = _nd((M, N), dt)
                try:
                    st = _local.handles[_get_device()]
                except (AttributeError, KeyError):
                    st = _state()
                stream = _get_stream().ptr
                if st.stream != stream:
                    st.set_stream(_lib, stream)
                status = _lib.cublasGemmEx(st.ptr, OP_N if bc else OP_T, OP_N if ac else OP_T, N, M, K,
                                           _ONE_REF if alpha == 1.0 else ctypes.byref(ctypes.c_float(alpha)),
                                           b.data.ptr, t, N if bc else K, a.data.ptr, t, K if ac else M, _ZERO_REF,
                                           out.data.ptr, t, N, _COMPUTE_32F, _GEMM_DEFAULT)
                if status:
                    _check(status, "GemmEx")
                return out
    cp = backend.cupy
    if b.ndim == 1 or a.ndim == 1:
        if out is not None:
            raise ValueError("matmul: out= needs 2-D operands or more")
        if b.ndim == 1:
            return matmul(a, b[:, None], alpha=alpha)[..., 0]
        return matmul(a[None, :], b, alpha=alpha)[..., 0, :]
    M, K = a.shape[-2:]
    N = b.shape[-1]
    # the common case (every linear): 2-D operands that fit, no batch to broadcast (a misfit takes the general path,
    # whose broadcast_to raises)
    plain = a.ndim == 2 and b.ndim == 2 and b.shape[0] == K
    same = not plain and a.shape[:-2] == b.shape[:-2]   # one batch shape (q @ k^T): nothing to broadcast
    batch = () if plain else a.shape[:-2] if same else tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    if out is None:
        out = new_output(batch + (M, N), M * N if not batch else _RC_MAX + 1, a.dtype)
        ldc = N
    else:
        wide = out.dtype == np.float32 and a.dtype in (np.float16, BF16)
        ldc = _out_layout(out, batch + (M, N), out.dtype if wide else a.dtype)
    if out.size == 0:
        return out
    if K == 0:
        if beta == 0.0:
            out.fill(0)
        else:
            out *= beta
        return out
    nb = len(batch)
    if plain:  # broadcast_to(a, a.shape) would be a view of a with its own strides: a itself
        A, opA, lda, sA = _prepare_2d(a)
        B, opB, ldb, sB = _prepare_2d(b)
    elif same and b.shape[-2] == K:
        A, opA, lda, sA = _prepare(a, nb)
        B, opB, ldb, sB = _prepare(b, nb)
    else:
        A, opA, lda, sA = _prepare(cp.broadcast_to(a, batch + (M, K)), nb)
        B, opB, ldb, sB = _prepare(cp.broadcast_to(b, batch + (K, N)), nb)
    count = math.prod(batch)
    t, tc = _CUDA_TYPE[a.dtype], _CUDA_TYPE[out.dtype]
    lib, h = _handle()
    one = _ONE_REF if alpha == 1.0 else ctypes.byref(ctypes.c_float(alpha))
    bet = _ZERO_REF if beta == 0.0 else ctypes.byref(ctypes.c_float(beta))
    # row-major C = A @ B  <=>  column-major C^T = B^T A^T: B's memory is the first operand
    if count == 1:
        _check(lib.cublasGemmEx(h, opB, opA, N, M, K, one, B.data.ptr, t, ldb, A.data.ptr, t, lda, bet,
                                out.data.ptr, tc, ldc, _COMPUTE_32F, _GEMM_DEFAULT), "GemmEx")
    else:
        _check(lib.cublasGemmStridedBatchedEx(h, opB, opA, N, M, K, one, B.data.ptr, t, ldb, sB, A.data.ptr, t,
                                              lda, sA, bet, out.data.ptr, tc, ldc, M * N, count, _COMPUTE_32F,
                                              _GEMM_DEFAULT), "GemmStridedBatchedEx")
    return out


def mm(a, b):
    """xp.matmul of two arrays, through `matmul` (cuBLAS) when both are CuPy arrays of one supported dtype (the
    reference paths of other kernels use it, so they too run inside CUDA graph captures)."""
    if backend.is_cuda_array(a) and a.dtype == b.dtype and supported(a.dtype):
        return matmul(a, b)
    return backend.xp_of(a).matmul(a, b)
