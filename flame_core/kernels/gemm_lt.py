"""y = a @ b + bias in one cuBLASLt matmul whose epilogue adds the bias (CUBLASLT_EPILOGUE_BIAS): no separate pass
over the (M, N) output, as PyTorch's addmm does for nn.Linear.

Reached through ctypes in the libcublasLt CuPy's cuBLAS already loaded, as `gemm` reaches cuBLAS. One matmul
descriptor, operand layouts and the heuristic's first algorithm are kept per problem (shape, leading dimensions,
transposes, dtype, alignments), and per thread what a call passes (`_RUNS`: a forward bias's descriptor holds its
address, so the call is one C call): it launches on the current CuPy stream, with the workspace from FLAME's pool
of the thread's cuBLAS handle (cuBLASLt allocates nothing itself, so the call can be captured in a CUDA graph).
Where cuBLASLt offers no algorithm the caller gets None and falls back to GEMM + add.

    matmul_bias(a, b, bias)   a (M, K) @ b (K, N) + bias, each operand row- or column-major
    linear_bias(x, w, bias)   nn.Linear's x (..., K) @ w (N, K)^T + bias on C-contiguous arrays: the eager per-op
                              path (no transposed view, no reshapes); None where it does not apply
    weight_bias_grad(g, x)    nn.Linear's backward dW = g^T x with the bias gradient g.sum(0) reduced inside the same
                              matmul (CUBLASLT_EPILOGUE_BGRADB, as apex's / flash-attention's fused dense layers): no
                              separate reduction and cast; None where it does not apply
"""
import ctypes
import os
import sys

import numpy as np

from .. import backend
from . import gemm, launching

_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
_EPILOGUE_BIAS = 4
_EPILOGUE_BGRADB = 512   # the bias gradient: sums of cuBLASLt's B over k (one per column of D)
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)   # A, B, C, D bytes (cuBLASLt assumes 256 unless told)
_CUDA_R_32F = 0
_ONE, _ZERO = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))   # alpha, beta (host, fp32)
_PTR_SIZE = ctypes.sizeof(ctypes.c_void_p)
WORKSPACE_BYTES = gemm.WORKSPACE_BYTES  # the shared workspace's size (gemm.workspace)


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


ENABLED = os.environ.get("FLAME_GEMM_BIAS_EPILOGUE", "1") != "0"   # 0: GEMM then a separate bias add (A/B runs)
_lib = None
_handles = {}      # device id -> cublasLt handle
_plans = {}        # problem key -> (matmul desc, layouts (a, b, c), algorithm) or None when there is none


def _library():
    global _lib
    if _lib is not None:
        return _lib
    gemm._libcublas()  # makes CuPy load cuBLAS, which loads cuBLASLt
    lib = gemm.loaded_library("libcublasLt.so")
    vp, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    pvp = ctypes.POINTER(vp)
    lib.cublasLtCreate.argtypes = [pvp]
    lib.cublasLtMatmulDescCreate.argtypes = [pvp, i, i]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [pvp, i, u64, u64, i64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [pvp]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(_Heuristic),
                                                   ctypes.POINTER(i)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    lib.cublasLtMatmulDescDestroy.argtypes = [vp]
    for fn in (lib.cublasLtCreate, lib.cublasLtMatmulDescCreate, lib.cublasLtMatmulDescSetAttribute,
               lib.cublasLtMatmulDescDestroy,
               lib.cublasLtMatrixLayoutCreate, lib.cublasLtMatmulPreferenceCreate,
               lib.cublasLtMatmulPreferenceSetAttribute, lib.cublasLtMatmulAlgoGetHeuristic, lib.cublasLtMatmul):
        fn.restype = ctypes.c_int
    _lib = lib
    return lib


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _handle(dev=None):
    """(cuBLASLt handle of the current device -- or of device id `dev` --, the workspace: the current thread's cuBLAS
    one, gemm.workspace())."""
    cp = backend.cupy
    if dev is None:
        dev = cp.cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        lib = _library()
        h = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(h)), "Create")
        _handles[dev] = h
    return h, gemm.workspace()


def _set(lib, desc, attr, value):
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), "DescSet")


def _new_desc(lib, t, opB, opA, epilogue):
    """A matmul descriptor: fp32 compute and scale, the transposes, the epilogue and its vector's dtype."""
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), gemm._COMPUTE_32F, _CUDA_R_32F), "DescCreate")
    _set(lib, desc, _DESC_TRANSA, ctypes.c_int(opB))
    _set(lib, desc, _DESC_TRANSB, ctypes.c_int(opA))
    _set(lib, desc, _DESC_EPILOGUE, ctypes.c_int(epilogue))
    _set(lib, desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int(t))
    return desc


def _plan(key, h):
    """(desc, (la, lb, lc), algo) for the problem `key`, or None when cuBLASLt has no algorithm for it."""
    if key in _plans:
        return _plans[key]
    lib = _library()
    dev, t, opB, opA, N, M, K, ldb, lda, ldc, aligns, epilogue = key
    desc = _new_desc(lib, t, opB, opA, epilogue)
    layouts = []
    # column-major view of row-major C = A @ B: C^T (N, M) = B^T (N, K) A^T (K, M); stored shapes follow the ops
    for rows, cols, ld in ((N, K, ldb) if opB == gemm.OP_N else (K, N, ldb),
                           (K, M, lda) if opA == gemm.OP_N else (M, K, lda),
                           (N, M, ldc)):
        lay = ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), t, rows, cols, ld), "LayoutCreate")
        layouts.append(lay)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    ws = ctypes.c_size_t(WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                    ctypes.sizeof(ws)), "PreferenceSet")
    for attr, align in zip(_PREF_MIN_ALIGNMENT, aligns):
        al = ctypes.c_uint32(align)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(al), ctypes.sizeof(al)),
               "PreferenceSet")
    result, count = _Heuristic(), ctypes.c_int(0)
    status = lib.cublasLtMatmulAlgoGetHeuristic(h, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref, 1,
                                                ctypes.byref(result), ctypes.byref(count))
    plan = None
    if status == 0 and count.value > 0 and result.state == 0:
        plan = (desc, layouts, ctypes.byref(result.algo), result)   # result: kept alive (the algorithm's memory)
    _plans[key] = plan
    return plan


class _Desc:
    """A matmul descriptor of one thread's run (see _RUNS), destroyed with it."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        if _lib is not None and not sys.is_finalizing():
            try:
                _lib.cublasLtMatmulDescDestroy(self.ptr)
            except Exception:   # a destructor cannot raise
                pass


# this thread's runs (launching.LaunchCache: per thread and device, dropped past its limit -- their descriptors
# destroyed -- and rebuilt on demand): problem (dtype, transposes, sizes, leading dimensions, the operands' addresses
# modulo 256 -- their alignments --, the bias address for a forward bias, epilogue) -> what one call passes
# (libcublasLt's matmul, handle, descriptor, layouts, algorithm, the bias pointer's holder, the workspace). A forward
# bias (a parameter's: its address is stable) has a descriptor of its own with the address already set, so a call is
# one C call; the bias gradient's address changes from call to call and is set into this thread's own descriptor
# first (no other thread writes it between the two calls).
_RUNS = launching.LaunchCache(1024)


def _new_run(key, t, opB, opA, N, M, K, ldb, lda, ldc, pb, pa, po, pbias, epilogue):
    """The run of `key` (see _RUNS) on the current device, or None when cuBLASLt has no algorithm for the problem."""
    dev = _get_device()
    h = _handles.get(dev)
    if h is None:
        h = _handle(dev)[0]
    ao = _alignment(po)
    plan = _plan((dev, t, opB, opA, N, M, K, ldb, lda, ldc, (_alignment(pb), _alignment(pa), ao, ao), epilogue), h)
    if plan is None:
        return None
    lib = _lib
    _, (l_b, l_a, l_c), algo, _ = plan
    desc = _Desc(_new_desc(lib, t, opB, opA, epilogue).value)
    holder = ctypes.c_void_p(pbias)
    holder_ref = ctypes.byref(holder)
    _check(lib.cublasLtMatmulDescSetAttribute(desc.ptr, _DESC_BIAS_POINTER, holder_ref, _PTR_SIZE), "DescSet")
    ws = gemm.workspace()   # held by the run: its memory stays this run's even if the handle is closed early
    return _RUNS.put(key, (lib.cublasLtMatmul, h, desc.ptr, l_b, l_a, l_c, algo, holder, holder_ref, ws.data.ptr,
                           (desc, ws)))


_nd = backend._cupy_ndarray   # cupy.ndarray, or () without CuPy (no array's type)
_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None
_get_stream = backend.cupy.cuda.get_current_stream if backend.cupy is not None else None


def linear_bias(x, w, bias):
    """nn.Linear's product x (..., K) @ w (N, K)^T + bias (N,) -> (..., N), the eager per-op path of matmul_bias: for
    C-contiguous cupy arrays of one supported dtype with K, N > 1 (x's leading dims flattened as rows, no transposed
    view, the plan's key read straight from the shapes and addresses); None otherwise or when cuBLASLt has no
    algorithm (the caller takes matmul_bias or GEMM + add)."""
    nd = _nd
    if (not ENABLED or type(x) is not nd or type(w) is not nd or type(bias) is not nd or not x._c_contiguous
            or not w._c_contiguous or not bias._c_contiguous):
        return None
    dt = x.dtype
    t = gemm._CUDA_TYPE.get(dt)
    if t is None or w.dtype != dt or bias.dtype != dt or w.ndim != 2 or x.ndim < 1:
        return None
    N, K = w.shape
    if N < 2 or K < 2 or x.shape[-1] != K or bias.shape != (N,):
        return None
    M = x.size // K
    pbias = bias.data.ptr
    if M == 0 or pbias & 15:
        return None
    out = gemm.new_output(x.shape[:-1] + (N,), M * N, dt)
    # cuBLASLt's A is w's memory read transposed (ld K), its B is x (ld K), C = D is out (ld N): see _plan
    if not _run(t, gemm.OP_T, gemm.OP_N, N, M, K, K, K, N, w.data.ptr, x.data.ptr, out.data.ptr, pbias,
                _EPILOGUE_BIAS):
        return None
    return out


def weight_bias_grad(g, x):
    """(dW, db) of nn.Linear's backward from the output gradient g (M, N) and the input x (M, K), C-contiguous cupy
    arrays of one supported dtype: dW = g^T x (N, K) and db = g.sum(0) (N,), both from one cuBLASLt matmul whose
    epilogue reduces g over the rows while it is read (float32 sums, rounded once). None where this does not apply
    (N or K below 2, a misaligned operand, no algorithm): the caller takes a GEMM and a reduction."""
    nd = _nd
    if not ENABLED or type(g) is not nd or type(x) is not nd or not g._c_contiguous or not x._c_contiguous:
        return None
    dt = g.dtype
    t = gemm._CUDA_TYPE.get(dt)
    if t is None or x.dtype != dt or g.ndim != 2 or x.ndim != 2:
        return None
    M, N = g.shape
    K = x.shape[1]
    if N < 2 or K < 2 or M < 1 or x.shape[0] != M:
        return None
    dw = gemm.new_output((N, K), N * K, dt)
    db = gemm.new_output((N,), N, dt)
    pbias = db.data.ptr
    if pbias & 15:
        return None
    # row-major dW = g^T @ x: cuBLASLt's A is x's memory (K, M column-major, op N), its B is g's (N, M column-major,
    # op T: B = g, whose sums over k = M are the bias gradient), D is dW (K, N column-major, ld K)
    if not _run(t, gemm.OP_N, gemm.OP_T, K, N, M, K, N, K, x.data.ptr, g.data.ptr, dw.data.ptr, pbias,
                _EPILOGUE_BGRADB):
        return None
    return dw, db


def _run(t, opB, opA, N, M, K, ldb, lda, ldc, pb, pa, po, pbias, epilogue):
    """Runs one matmul on the current device and stream (planned once per problem, see _RUNS), cuBLASLt's A at pb
    and B at pa (see _plan), C = D at po, the epilogue's vector at pbias; False when cuBLASLt has no algorithm for
    it."""
    own = epilogue == _EPILOGUE_BIAS
    key = (t, opB, opA, N, M, K, ldb, lda, ldc, pb & 255, pa & 255, po & 255, pbias if own else 0, epilogue)
    run = _RUNS.get(key)
    if run is None:
        run = _new_run(key, t, opB, opA, N, M, K, ldb, lda, ldc, pb, pa, po, pbias, epilogue)
        if run is None:
            return False
    fn, h, desc, l_b, l_a, l_c, algo, holder, holder_ref, ws, _ = run
    if not own:
        holder.value = pbias
        _check(_lib.cublasLtMatmulDescSetAttribute(desc, _DESC_BIAS_POINTER, holder_ref, _PTR_SIZE), "DescSet")
    status = fn(h, desc, _ONE, pb, l_b, pa, l_a, _ZERO, po, l_c, po, l_c, algo, ws, WORKSPACE_BYTES,
                _get_stream().ptr)
    if status:
        _check(status, "Matmul")
    return True


def _alignment(ptr):
    """The largest power of two up to 256 that divides the address."""
    return min(256, ptr & -ptr) if ptr else 256


def matmul_bias(a, b, bias):
    """a (M, K) @ b (K, N) + bias (N,) for 2-D cupy arrays of one supported dtype (each operand row- or column-major),
    as a new (M, N) array; None when this problem has no cuBLASLt algorithm (the caller does GEMM + add)."""
    cp = backend.cupy
    M, K = a.shape
    N = b.shape[1]
    if not ENABLED or M == 0 or N == 0 or K == 0 or not gemm.supported(a.dtype) or not a.dtype == b.dtype == bias.dtype:
        return None
    la, lb = gemm._layout(a), gemm._layout(b)
    if la is None or lb is None or not bias.flags.c_contiguous or bias.data.ptr % 16:
        return None
    (opA, lda), (opB, ldb) = la, lb
    out = cp.empty((M, N), dtype=a.dtype)
    # cuBLASLt's A is b's memory (see _plan); C is D
    if not _run(gemm._CUDA_TYPE[np.dtype(a.dtype)], opB, opA, N, M, K, ldb, lda, N, b.data.ptr, a.data.ptr,
                out.data.ptr, bias.data.ptr, _EPILOGUE_BIAS):
        return None
    return out
