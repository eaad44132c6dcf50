"""out = scale_a * scale_b * (a @ b^T) + bias for e4m3 operands: the fp8 tensor-core GEMM (torch._scaled_mm's
contract, FLAME's layout).

    scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=bfloat16, fast_accum=False) -> (M, N) array

a (M, K) and b (N, K) hold float8_e4m3fn values (uint8 bytes on cuda, ml_dtypes float8 or bytes on cpu), both
C-contiguous, so both are K-major: the only layout ("TN") Hopper's fp8 tensor cores take. y = x @ W^T of a Linear
is this shape as it stands (W is (out, in)); the input gradient dY @ W needs W's transposed copy
(fp8_tensor.transpose_fp8).
scale_a / scale_b: float32 arrays whose first element is the per-tensor dequantisation factor. bias (N,) of out_dtype.

cuda: one cuBLASLt matmul (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER, fp32 accumulation -- with the tensor cores' partial
sums promoted to fp32 unless fast_accum --, bias in the epilogue, out_dtype written directly), through ctypes and the
handle and workspace of gemm_lt. The algorithm: the fastest of the heuristic's first CANDIDATES, timed once per problem
(shape, dtypes, bias, fast_accum, alignments) on the first eager call's operands and cached; a call during CUDA graph
capture before that takes the heuristic's first. Where cuBLASLt has no fp8 algorithm for the problem (K or a leading
dimension not a multiple of 16, a misaligned pointer, a GPU before sm_89) the same numbers are computed by emulation.
cpu (and that fallback): emulation -- the operands widened to float32, multiplied with float32 accumulation, scaled,
the bias added, rounded once to out_dtype. `last_path` says which ran ('cublaslt' | 'emulated').
"""
import ctypes

import ml_dtypes
import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import gemm, gemm_lt

_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_FAST_ACCUM = 17, 18, 25
_EPILOGUE_DEFAULT = 1
_CUDA_R_8F_E4M3 = 28
BF16 = np.dtype(ml_dtypes.bfloat16)
_plans = {}        # problem key -> _Plan, or None when cuBLASLt has no algorithm for it
CANDIDATES = 8     # the heuristic's best few algorithms, timed once per problem (its first is 1.15-1.34x torch's
                   # choice at some of Flux's shapes, bench/fp8_gemm.py)
TUNE_REPEATS = 5
last_path = None   # 'cublaslt' | 'emulated': the path of the latest call (tests and benches read it)
last_plan = None   # the _Plan of the latest cuBLASLt call (benches report its candidates' times)


def _as_f32(q):
    """e4m3 bytes / float8 values -> float32 values (NumPy or CuPy)."""
    if backend.is_cuda_array(q):
        table = _e4m3_table_cuda()
        return table[q.view(np.uint8) if q.dtype != np.uint8 else q]
    if q.dtype == np.uint8:
        q = q.view(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32)


_tables = {}


def _e4m3_table_cuda():
    """The 256 e4m3 values as a float32 lookup table on the current device (emulation on cuda)."""
    cp = backend.cupy
    dev = cp.cuda.Device().id
    if dev not in _tables:
        _tables[dev] = cp.asarray(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    return _tables[dev]


def _emulated(a, b, scale_a, scale_b, bias, out_dtype):
    xp = backend.xp_of(a)
    acc = _as_f32(a) @ _as_f32(b).T
    s = (xp.asarray(scale_a, dtype=np.float32).reshape(-1)[:1] * xp.asarray(scale_b, dtype=np.float32).reshape(-1)[:1])
    y = acc * s
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(out_dtype)


class _Plan:
    """One problem's matmul descriptor, operand layouts (b, a, out), the heuristic's candidate algorithms (best
    first) and the one chosen by timing them (None until timed: see _tune)."""
    __slots__ = ("desc", "layouts", "candidates", "algo", "times_ms")

    def __init__(self, desc, layouts, candidates):
        self.desc, self.layouts, self.candidates = desc, layouts, candidates
        self.algo, self.times_ms = None, None


def _plan(key, h):
    if key in _plans:
        return _plans[key]
    lib = gemm_lt._library()
    dev, t_out, N, M, K, has_bias, fast, aligns = key
    desc = ctypes.c_void_p()
    gemm_lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), gemm._COMPUTE_32F, gemm_lt._CUDA_R_32F),
                   "DescCreate")
    # column-major: out^T (N, M) = b (N, K) . a^T (K, M): cuBLASLt's A is b (stored (K, N), op T), its B is a
    gemm_lt._set(lib, desc, gemm_lt._DESC_TRANSA, ctypes.c_int(gemm.OP_T))
    gemm_lt._set(lib, desc, gemm_lt._DESC_TRANSB, ctypes.c_int(gemm.OP_N))
    gemm_lt._set(lib, desc, gemm_lt._DESC_EPILOGUE, ctypes.c_int(gemm_lt._EPILOGUE_BIAS if has_bias
                                                                 else _EPILOGUE_DEFAULT))
    if has_bias:
        gemm_lt._set(lib, desc, gemm_lt._DESC_BIAS_DATA_TYPE, ctypes.c_int(t_out))
    gemm_lt._set(lib, desc, _DESC_FAST_ACCUM, ctypes.c_int8(1 if fast else 0))
    layouts = []
    for t, rows, cols, ld in ((_CUDA_R_8F_E4M3, K, N, K), (_CUDA_R_8F_E4M3, K, M, K), (t_out, N, M, N)):
        lay = ctypes.c_void_p()
        gemm_lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), t, rows, cols, ld), "LayoutCreate")
        layouts.append(lay)
    pref = ctypes.c_void_p()
    gemm_lt._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    ws = ctypes.c_size_t(gemm_lt.WORKSPACE_BYTES)
    gemm_lt._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, gemm_lt._PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                            ctypes.sizeof(ws)), "PreferenceSet")
    for attr, align in zip(gemm_lt._PREF_MIN_ALIGNMENT, aligns):
        al = ctypes.c_uint32(align)
        gemm_lt._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(al), ctypes.sizeof(al)),
                       "PreferenceSet")
    results, count = (gemm_lt._Heuristic * CANDIDATES)(), ctypes.c_int(0)
    status = lib.cublasLtMatmulAlgoGetHeuristic(h, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref,
                                                CANDIDATES, results, ctypes.byref(count))
    found = [results[i] for i in range(count.value)] if status == 0 else []
    found = [r for r in found if r.state == 0]
    plan = _Plan(desc, layouts, found) if found else None
    _plans[key] = plan
    return plan


def pick_fastest(candidates, time_ms):
    """(index of the fastest candidate, the times): time_ms(candidate) -> milliseconds, or None where the candidate
    failed to run; the first candidate (the heuristic's own choice) wins ties and is kept when none ran."""
    times = [time_ms(c) for c in candidates]
    ran = [i for i, t in enumerate(times) if t is not None]
    if not ran:
        return 0, times
    return min(ran, key=lambda i: (times[i], i)), times


def _tune(plan, launch):
    """Choose plan.algo among plan.candidates by timing each on this call's operands (TUNE_REPEATS launches between
    CUDA events, after one untimed): once per problem, outside CUDA graph capture (a capture takes the heuristic's
    first answer and leaves the choice to the next eager call). launch(algo) -> cuBLASLt's status."""
    cp = backend.cupy
    stream = cp.cuda.get_current_stream()
    if len(plan.candidates) == 1 or (stream.ptr and stream.is_capturing()):
        if len(plan.candidates) == 1:
            plan.algo, plan.times_ms = plan.candidates[0], [None]
        return plan.candidates[0]

    def time_ms(cand):
        if launch(cand) != 0:
            return None
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(TUNE_REPEATS):
            if launch(cand) != 0:
                return None
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / TUNE_REPEATS

    best, plan.times_ms = pick_fastest(plan.candidates, time_ms)
    plan.algo = plan.candidates[best]
    return plan.algo


def _check_args(a, b, scale_a, scale_b, bias, out_dtype):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ShapeError(f"scaled_mm: a {tuple(a.shape)} and b {tuple(b.shape)} must be (M, K) and (N, K)")
    for name, q in (("a", a), ("b", b)):
        if q.dtype not in (np.uint8, np.dtype(ml_dtypes.float8_e4m3fn)):
            raise DTypeError(f"scaled_mm: {name} must hold float8_e4m3fn values (uint8 bytes), got {q.dtype}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != np.float32 or s.size < 1:
            raise DTypeError(f"scaled_mm: {name} must be a float32 array of at least one element, got {s.dtype} "
                             f"{tuple(s.shape)}")
    if np.dtype(out_dtype) not in (BF16, np.dtype(np.float16), np.dtype(np.float32)):
        raise DTypeError(f"scaled_mm: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and (tuple(bias.shape) != (b.shape[0],) or bias.dtype != np.dtype(out_dtype)):
        raise ShapeError(f"scaled_mm: bias must be ({b.shape[0]},) of {np.dtype(out_dtype)}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")


def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=BF16, fast_accum=False):
    """See the module docstring."""
    global last_path, last_plan
    out_dtype = np.dtype(out_dtype)
    _check_args(a, b, scale_a, scale_b, bias, out_dtype)
    M, K = a.shape
    N = b.shape[0]
    if not backend.is_cuda_array(a) or M == 0 or N == 0 or K == 0:
        last_path = "emulated"
        return _emulated(a, b, scale_a, scale_b, bias, out_dtype)
    cp = backend.cupy
    a, b = (q if q.dtype == np.uint8 else q.view(np.uint8) for q in (a, b))
    ok = (a.flags.c_contiguous and b.flags.c_contiguous and K % 16 == 0 and gemm.supported(out_dtype)
          and (bias is None or (bias.flags.c_contiguous and bias.data.ptr % 16 == 0)))
    plan = None
    if ok:
        h, ws = gemm_lt._handle()
        out = cp.empty((M, N), dtype=out_dtype)
        aligns = tuple(gemm_lt._alignment(x.data.ptr) for x in (b, a, out, out))
        t_out = gemm._CUDA_TYPE[out_dtype]
        plan = _plan((cp.cuda.Device().id, t_out, N, M, K, bias is not None, bool(fast_accum), aligns), h)
    if plan is None:
        last_path = "emulated"
        return _emulated(a, b, scale_a, scale_b, bias, out_dtype)
    desc, (l_b, l_a, l_c) = plan.desc, plan.layouts
    lib = gemm_lt._library()
    # the scales are read on the device when the matmul runs: the pointers are set per call (a plan is shared)
    gemm_lt._set(lib, desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(scale_b.data.ptr))
    gemm_lt._set(lib, desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(scale_a.data.ptr))
    if bias is not None:
        gemm_lt._set(lib, desc, gemm_lt._DESC_BIAS_POINTER, ctypes.c_void_p(bias.data.ptr))
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    stream = cp.cuda.get_current_stream().ptr

    def launch(cand):
        return lib.cublasLtMatmul(h, desc, ctypes.byref(one), b.data.ptr, l_b, a.data.ptr, l_a, ctypes.byref(zero),
                                  out.data.ptr, l_c, out.data.ptr, l_c, ctypes.byref(cand.algo), ws.data.ptr,
                                  gemm_lt.WORKSPACE_BYTES, stream)

    algo = plan.algo if plan.algo is not None else _tune(plan, launch)
    gemm_lt._check(launch(algo), "Matmul")   # the result: written by the chosen algorithm last
    last_path, last_plan = "cublaslt", plan
    return out
