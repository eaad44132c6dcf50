"""Per-tensor fp8 (float8_e4m3fn) quantisation with current scaling, and the byte transpose, for the fp8 GEMM
(kernels: cuda_src/fp8_tensor.cu).

    quantize_per_tensor(x) -> (q, scale)   q: uint8 array of x's shape holding e4m3 bits; scale: float32 (2,) with
                                           scale[0] = amax(|x|) / 448 (x ~= q * scale[0]; 1 for an all-zero x) and
                                           scale[1] = 448 / amax, the factor the cast used
    quantize_parts_per_tensor(parts)    -> (q, scale) of the column concatenation of (rows, c_p) arrays, without
                                           forming it (q (rows, sum c_p)); the same bits as quantize_per_tensor of it
    transpose_fp8(q)                    -> the (cols, rows) C-contiguous copy of a 2-D byte array
    quantize_delayed(x, site)           -> (q, scale) with `site`'s delayed scaling (DelayedScaling): the factor from
                                           its earlier calls' amaxes, one pass (the first call: current scaling)
    quantize_with_scale(x, scale)       -> (q, scale) cast with a given pair (a recompute repeating its forward)
    quantize_parts_delayed(parts, site), quantize_parts_with_scale(parts, scale)   the same over column parts

"Current" scaling: the amax is this call's, not a history's (delayed scaling), so no state is carried between steps
and the first step is as exact as the others. On the GPU it is one launch (fp8_quantize_tensor: the amax, a grid-wide
barrier, the cast), and the amax and the scale never leave the device (no synchronisation; a CUDA graph captures it).
One quantisation at a time per device. The numbers are fp32 throughout, so the kernel and the NumPy reference agree bit
for bit (tests/kernels/test_fp8_gemm.py).
"""
import os

import ml_dtypes
import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError
from . import launching as KL
from . import loader as L
from . import plans as P

FP8_MAX = np.float32(448.0)
# fp8_transpose_64 (16-byte loads and stores through a 64x64 tile) for weights whose sides are multiples of 64; False:
# the byte-wise fp8_transpose everywhere (A/B)
TRANSPOSE_64 = True
GRID_BLOCKS_PER_SM = 4   # fp8_quantize_tensor's __launch_bounds__(256, 4): a quarter of an SM's threads per block
_FLOATS = ("float16", "bfloat16", "float32")
MAX_PARTS = 4            # fp8_quantize_parts' pointer arguments
# quantize_parts_per_tensor on cuda: the one-launch kernel (True) or the parts copied into one array and
# quantize_per_tensor of it (False: the same bits, one more write and read of the concatenation). The kernel is the
# default (H200, 2026-12-02: bit-equal to quantising the concatenation in every GPU test); FLAME_FP8_PARTS_KERNEL=0
# copies the parts instead.
PARTS_KERNEL = os.environ.get("FLAME_FP8_PARTS_KERNEL", "1") != "0"


def _quantize_ref(x):
    xf = backend.to_numpy(x).astype(np.float32)
    amax = np.float32(np.abs(xf).max()) if xf.size else np.float32(0)
    safe = bool(amax > 0 and np.isfinite(amax))
    scale = np.array([amax / FP8_MAX if safe else 1, FP8_MAX / amax if safe else 1], dtype=np.float32)
    q = np.clip(xf * scale[1], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    xp = backend.xp_of(x)
    return xp.asarray(q), xp.asarray(scale)


_resident = {}   # kernel -> blocks the whole GPU holds at once


def _resident_blocks(fn):
    """The grid fp8_quantize_tensor may use: every block resident at once (its grid barrier waits for all of them),
    at most GRID_BLOCKS_PER_SM per SM, fewer if the occupancy calculator says so."""
    if fn not in _resident:
        per_sm = min(GRID_BLOCKS_PER_SM, KL.max_active_blocks(fn, 256))
        _resident[fn] = max(1, per_sm) * P.sm_count()
    return _resident[fn]


def quantize_per_tensor(x):
    """(q, scale) of a float16 / bfloat16 / float32 array (any shape) -- see the module docstring."""
    if L.dtype_name(x.dtype) not in _FLOATS:
        raise DTypeError(f"quantize_per_tensor: expects a float16/bfloat16/float32 array, got {x.dtype}")
    if not (L.use_kernel(x) and x.size):
        return _quantize_ref(x)
    cp = backend.cupy
    x = P.contiguous(x)
    scale = cp.empty(2, dtype=np.float32)
    q = cp.empty(x.shape, dtype=np.uint8)
    n = int(x.size)
    fn = L.get_function("fp8_tensor", "fp8_quantize_tensor", x.dtype)
    grid = (max(1, min(P.cdiv(P.cdiv(n, 8), 256), _resident_blocks(fn))),)
    KL.launch(fn, grid, (256,), (x, q, scale, KL.i64(n)))
    return q, scale

def quantize_parts_per_tensor(parts):
    """(q, scale) of the column concatenation of `parts` -- 2-D (rows, c_p) arrays of one float16 / bfloat16 /
    float32 dtype and one row count -- as quantize_per_tensor of it (one amax over all the parts, the same bits):
    q (rows, sum c_p) bytes. On cuda one launch reads the parts in place (fp8_quantize_parts, up to MAX_PARTS parts,
    when PARTS_KERNEL is on); otherwise they are copied into one array first."""
    if not parts or any(p.ndim != 2 or p.shape[0] != parts[0].shape[0] for p in parts):
        raise ShapeError(f"quantize_parts_per_tensor: expects 2-D parts with one row count, got "
                         f"{[tuple(p.shape) for p in parts]}")
    dt = parts[0].dtype
    if any(p.dtype != dt for p in parts) or L.dtype_name(dt) not in _FLOATS:
        raise DTypeError(f"quantize_parts_per_tensor: expects parts of one float16/bfloat16/float32 dtype, got "
                         f"{[str(p.dtype) for p in parts]}")
    if len(parts) == 1:
        return quantize_per_tensor(parts[0])
    rows, width = parts[0].shape[0], sum(int(p.shape[1]) for p in parts)
    x0 = parts[0]
    if PARTS_KERNEL and len(parts) <= MAX_PARTS and L.use_kernel(x0) and rows * width:
        cp = backend.cupy
        parts = [P.contiguous(p) for p in parts]
        scale = cp.empty(2, dtype=np.float32)
        q = cp.empty((rows, width), dtype=np.uint8)
        fn = L.get_function("fp8_tensor", "fp8_quantize_parts", dt)
        grid = (max(1, min(P.cdiv(P.cdiv(rows * width, 8), 256), _resident_blocks(fn))),)
        xs = parts + [parts[0]] * (MAX_PARTS - len(parts))
        cs = [int(p.shape[1]) for p in parts] + [0] * (MAX_PARTS - len(parts))
        KL.launch(fn, grid, (256,), (*xs, *(KL.i64(c) for c in cs), KL.i64(rows), q, scale))
        return q, scale
    whole = backend.xp_of(x0).empty((rows, width), dtype=dt)
    lo = 0
    for p in parts:                                  # column-block copies (a CUDA graph captures them)
        whole[:, lo:lo + p.shape[1]] = p
        lo += p.shape[1]
    return quantize_per_tensor(whole)



HISTORY = 16  # amaxes a delayed-scaling site remembers (its next factor comes from their max)


class DelayedScaling:
    """One quantisation site's delayed scaling (TransformerEngine's recipe): the factor of each call comes from the
    amaxes of the site's earlier calls, so the cast is one pass with no wait for this call's amax (see
    quantize_delayed). `state` (float32 (3 + history,), on the site's device, made at its first call): the
    dequantisation scale and cast factor the next call uses, this call's amax (0 between calls), the history of
    amaxes (newest first). A site is one tensor role of one layer (its input, its output gradient): their ranges
    differ by orders of magnitude."""

    def __init__(self, history=HISTORY):
        if int(history) < 1:
            raise ValueError(f"DelayedScaling: history must be >= 1, got {history}")
        self.history = int(history)
        self.state = None

    def reset(self):
        """Forget the history: the next call scales by its own amax again (current scaling), as the first did."""
        self.state = None

    def _start(self, scale):
        """The state after a first call quantised with current scaling to `scale` (scale[0] = its amax / 448)."""
        xp = backend.xp_of(scale)
        st = xp.zeros(3 + self.history, dtype=np.float32)
        st[0:2] = scale
        st[3] = scale[0] * FP8_MAX   # the first call's amax (448 for an all-zero tensor, whose scale is 1)
        self.state = st


def _delayed_ref(x, st):
    """The kernel's numbers in NumPy / CuPy (fp32 throughout): q, scale_out; st updated in place."""
    xp = backend.xp_of(x)
    xf = x.astype(np.float32)
    scale_out = st[0:2].copy()
    q = xp.clip(xf * st[1], -FP8_MAX, FP8_MAX)
    q = xp.asarray(backend.to_numpy(q).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    v = np.abs(backend.to_numpy(xf)).reshape(-1)
    v = v[~np.isnan(v)]                              # the kernel's fmaxf passes over NaN
    a = np.float32(v.max()) if v.size else np.float32(0)
    if not np.isfinite(a):                           # an inf: nothing recorded
        a = np.float32(0)
    h = backend.to_numpy(st[3:]).copy()
    h[1:] = h[:-1].copy()
    h[0] = a
    m = np.float32(h.max())
    safe = bool(m > 0 and np.isfinite(m))
    st[3:] = xp.asarray(h)
    st[0] = m / FP8_MAX if safe else np.float32(1)
    st[1] = FP8_MAX / m if safe else np.float32(1)
    st[2] = 0
    return q, scale_out


def quantize_delayed(x, site):
    """(q, scale) of a float16 / bfloat16 / float32 array as quantize_per_tensor's, with `site`'s delayed scaling
    (a DelayedScaling): its first call (or the first after reset()) scales by its own amax -- current scaling -- and
    starts the history; later calls cast with the factor the history gives (values beyond it saturate to +-448) in
    one pass (fp8_quantize_delayed) and add their amax to it. `scale` is what this call used (cuBLASLt's operand
    scale); a CUDA graph captures the call, and each replay moves the history on the device."""
    if L.dtype_name(x.dtype) not in _FLOATS:
        raise DTypeError(f"quantize_delayed: expects a float16/bfloat16/float32 array, got {x.dtype}")
    st = site.state
    if st is None or backend.is_cuda_array(st) != backend.is_cuda_array(x) or (
            backend.is_cuda_array(x) and st.device.id != x.device.id):
        if backend.is_cuda_array(x) and backend.cupy.cuda.get_current_stream().is_capturing():
            # a graph would replay the first call's current scaling and restart the history at every replay
            from ..cuda.graphs import GraphCaptureError
            raise GraphCaptureError("quantize_delayed: a site's first call must run before a CUDA graph capture (its "
                                    "own amax starts the history); run the step eagerly once first")
        q, scale = quantize_per_tensor(x)
        site._start(scale)
        return q, scale
    if not (L.use_kernel(x) and x.size):
        return _delayed_ref(x, st)
    return _delayed_kernel(x, st, site.history, 1)


def delayed_grid(n):
    """The grid of a delayed-scaling cast over n elements (fp8_delayed.cuh: blocks of 256 threads, 8 elements a thread
    and pass, no grid barrier, so any size is right; up to 8 blocks per SM keeps the amax fold's atomics few)."""
    return (max(1, min(P.cdiv(P.cdiv(n, 8), 256), P.sm_count() * 8)),)


def _delayed_kernel(x, st, hist, update):
    """fp8_quantize_delayed of x with the state (or, update 0, the fixed pair) `st`: (q, the pair used)."""
    cp = backend.cupy
    x = P.contiguous(x)
    scale = cp.empty(2, dtype=np.float32)
    q = cp.empty(x.shape, dtype=np.uint8)
    n = int(x.size)
    fn = L.get_function("fp8_tensor", "fp8_quantize_delayed", x.dtype)
    KL.launch(fn, delayed_grid(n), (256,), (x, q, st, scale, KL.i64(n), KL.i32(hist), KL.i32(update)))
    return q, scale


def _check_parts(parts, what):
    if not parts or any(p.ndim != 2 or p.shape[0] != parts[0].shape[0] for p in parts):
        raise ShapeError(f"{what}: expects 2-D parts with one row count, got {[tuple(p.shape) for p in parts]}")
    dt = parts[0].dtype
    if any(p.dtype != dt for p in parts) or L.dtype_name(dt) not in _FLOATS:
        raise DTypeError(f"{what}: expects parts of one float16/bfloat16/float32 dtype, got "
                         f"{[str(p.dtype) for p in parts]}")


def _concat(parts):
    return backend.xp_of(parts[0]).concatenate(parts, axis=1)


def _parts_kernel(parts, st, scale_out, hist, update):
    """fp8_quantize_parts_delayed over 2..MAX_PARTS C-contiguous parts: q (rows, sum c_p)."""
    cp = backend.cupy
    parts = [P.contiguous(p) for p in parts]
    rows, width = parts[0].shape[0], sum(int(p.shape[1]) for p in parts)
    q = cp.empty((rows, width), dtype=np.uint8)
    fn = L.get_function("fp8_tensor", "fp8_quantize_parts_delayed", parts[0].dtype)
    xs = parts + [parts[0]] * (MAX_PARTS - len(parts))
    cs = [int(p.shape[1]) for p in parts] + [0] * (MAX_PARTS - len(parts))
    KL.launch(fn, delayed_grid(rows * width), (256,), (*xs, *(KL.i64(c) for c in cs), KL.i64(rows), q, st, scale_out,
                                                      KL.i32(hist), KL.i32(update)))
    return q


def _kernel_parts(parts):
    return (PARTS_KERNEL and 1 < len(parts) <= MAX_PARTS and L.use_kernel(parts[0])
            and parts[0].shape[0] * sum(int(p.shape[1]) for p in parts))


def quantize_parts_delayed(parts, site):
    """quantize_delayed of the column concatenation of `parts` (2-D (rows, c_p), one dtype and row count), without
    forming it on cuda (fp8_quantize_parts_delayed, up to MAX_PARTS parts): one site, one history for all parts."""
    _check_parts(parts, "quantize_parts_delayed")
    if len(parts) == 1:
        return quantize_delayed(parts[0], site)
    st = site.state
    if (st is None or not _kernel_parts(parts) or not backend.is_cuda_array(st)
            or st.device.id != parts[0].device.id):
        return quantize_delayed(_concat(parts), site)   # first call, cpu, or more parts than the kernel takes
    scale = backend.cupy.empty(2, dtype=np.float32)
    return _parts_kernel(parts, st, scale, site.history, 1), scale


def quantize_parts_with_scale(parts, scale):
    """quantize_with_scale of the column concatenation of `parts`, without forming it on cuda."""
    _check_parts(parts, "quantize_parts_with_scale")
    if len(parts) == 1:
        return quantize_with_scale(parts[0], scale)
    if not _kernel_parts(parts):
        return quantize_with_scale(_concat(parts), scale)
    out = backend.cupy.empty(2, dtype=np.float32)
    return _parts_kernel(parts, P.contiguous(scale), out, 0, 0), out


def quantize_with_scale(x, scale):
    """(q, scale') of x cast with a given (dequantisation scale, cast factor) pair `scale` (float32 (2,), e.g. what an
    earlier quantize_delayed returned): no amax, nothing updated; scale' a copy of the pair. For a checkpointed
    region's recompute, which must quantise exactly as its forward did."""
    if L.dtype_name(x.dtype) not in _FLOATS:
        raise DTypeError(f"quantize_with_scale: expects a float16/bfloat16/float32 array, got {x.dtype}")
    if not (L.use_kernel(x) and x.size):
        xp = backend.xp_of(x)
        q = xp.clip(x.astype(np.float32) * scale[1], -FP8_MAX, FP8_MAX)
        return xp.asarray(backend.to_numpy(q).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)), scale[0:2].copy()
    return _delayed_kernel(x, P.contiguous(scale), 0, 0)


def transpose_fp8(q, out=None):
    """q (rows, cols) bytes (uint8, or float8 on the cpu) -> the C-contiguous (cols, rows) transpose, written into
    `out` (C-contiguous, of that shape and q's dtype) or a new array."""
    if q.ndim != 2:
        raise ShapeError(f"transpose_fp8: expects a 2-D array, got shape {tuple(q.shape)}")
    rows, cols = q.shape
    if out is not None and (tuple(out.shape) != (cols, rows) or out.dtype != q.dtype or not out.flags.c_contiguous):
        raise ShapeError(f"transpose_fp8: out must be a C-contiguous {(cols, rows)} array of {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if not backend.is_cuda_array(q) or not L.enabled() or q.size == 0:
        if out is None:
            return backend.xp_of(q).ascontiguousarray(q.T)
        out[...] = q.T
        return out
    if q.dtype != np.uint8:
        raise DTypeError(f"transpose_fp8: expects uint8 bytes on cuda, got {q.dtype}")
    q = P.contiguous(q)
    if out is None:
        out = backend.cupy.empty((cols, rows), dtype=np.uint8)
    if TRANSPOSE_64 and rows % 64 == 0 and cols % 64 == 0 and not (q.data.ptr | out.data.ptr) % 16:
        KL.launch(L.get_function("fp8_tensor", "fp8_transpose_64"), (cols // 64, rows // 64), (256,),
                  (q, out, KL.i64(rows), KL.i64(cols)))
    else:
        KL.launch(L.get_function("fp8_tensor", "fp8_transpose"), (P.cdiv(cols, 32), P.cdiv(rows, 32)), (32, 8),
                  (q, out, KL.i64(rows), KL.i64(cols)))
    return out
