"""GEMMs of small problems through cuda_src/gemm_small.cu, for the per-op host cost of eager linear layers.

A product of a few hundred thousand multiply-adds takes the GPU a few microseconds, while one cuBLAS or cuBLASLt call
spends 10-15 us of host time inside the library (its heuristics and checks) before the launch: an eager MLP's layer
(a forward and a backward GEMM pair) costs about three of those. Here a small problem's kernel is launched through a
`launching.PackedLaunch` kept per (kernel, dtype, dimensions, strides, device) and thread -- a dict hit and a driver
launch --, and a linear layer's whole backward (dx, dW and the bias gradient) is one launch.

What is small: every dimension at most MAX_DIM and M * N * K at most MAX_MACS, float32 / float16 / bfloat16
C-contiguous cupy arrays (matmul: or transposed views of such) of one dtype on the current device, kernels enabled
(FLAME_KERNELS, no loader.reference() block). The bound is bench/small_gemm.py's (H100, 720c129): the kernel runs
its reduction serially over 64-wide slabs, each slab's loads in registers before its shared-memory stores, ~0.9 us of
GPU time per slab. Up to 256 a side and 2^22 multiply-adds its GPU time stays within ~2.5 us of cuBLAS's (float32:
at or below it; the backward's single launch below cuBLAS's three) -- what a CUDA graph replay pays, where no host
cost is -- while an eager call saves 5-20 us of host time forward and 25-40 us backward; longer reductions (9.3 us
against torch's 4.9 at 16 x 64 x 512) take cuBLAS.
FLAME_SMALL_GEMM=0 switches this path off (A/B measurements).

API: each returns new cupy arrays, or None when the path does not apply (the caller takes cuBLAS / cuBLASLt).
``linear(x, w, bias)``       x (..., K) @ w (N, K)^T (+ bias (N,), or None) -> (..., N).
``matmul(a, b)``             a (M, K) @ b (K, N) -> (M, N), 2-D arrays, each row-major or a transposed view of one.
``linear_grads(g, x, w, need_dx, need_dw, need_db)``  a linear layer's (dx, dW, db) from g (M, N), x (M, K) and
                             w (N, K) in one launch; None for each one not asked for (x may be None without dW, w
                             without dx).

Math: fp32 accumulation over the reduction in order, one rounding to the dtype (the bias added in fp32 before it, as
cuBLASLt's epilogue): within float32 rounding of cuBLAS's result, not bit-identical (another summation order).
"""
import os
import threading

import ml_dtypes
import numpy as np

from .. import backend
from . import gemm, launching, loader, plans
from . import pointwise_small as _ps

MAX_DIM = 256   # bench/small_gemm.py: each 64-wide reduction slab adds ~0.9 us of GPU time (H100)
MAX_MACS = 1 << 22 if os.environ.get("FLAME_SMALL_GEMM", "1") != "0" else -1
TILE = 16
STEM = "gemm_small"

_nd = backend._cupy_ndarray if backend.cupy is not None else None
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_KIND = {d.num: k for k, d in enumerate(_DTYPES)}
_new_output = gemm.new_output


class _Launches(dict):
    """This thread's PackedLaunches by (kernel, dtype kind, I, J, R, strides, device): a miss builds the launch
    (`__missing__`), so the per-op callers index the dict and run no frame of their own for it. Past 1024 entries
    it is cleared and rebuilt on demand (a stream of distinct shapes stays bounded)."""

    def __missing__(self, key):
        name, kind, i, j, r, sai, sar, sbj, sbr, _dev = key
        if len(self) >= 1024:
            self.clear()
        if name == "gs_gemm":
            grid, n_dynamic, scalars = (plans.cdiv(j, TILE), plans.cdiv(i, TILE)), 4, (i, j, r, sai, sar, sbj, sbr)
        else:   # gs_linear_bwd: i, j, r = M, N, K
            grid, n_dynamic, scalars = (plans.cdiv(r, TILE), plans.cdiv(max(i, j), TILE), 2), 6, (i, j, r)
        kernel = loader.get_function(STEM, name, _DTYPES[kind])
        pl = self[key] = launching.PackedLaunch(kernel, grid, (TILE, TILE),
                                                (None,) * n_dynamic + tuple(np.int32(v) for v in scalars), n_dynamic)
        return pl


class _Local(threading.local):
    def __init__(self):  # runs once in each thread that touches it
        self.launches = _Launches()


_local = _Local()  # a packed buffer is rewritten per call: one set of launches per thread


def cached_launches():
    """How many PackedLaunches this thread holds (tests: a second call of a problem reuses the first's)."""
    return len(_local.launches)


def _device(*arrays):
    """The current device when kernels are enabled and every array (None entries aside) lives on it; else None (the
    small-array paths' check: pointwise_small.kernels_ready and current_device)."""
    if not _ps.kernels_ready():
        return None
    return 0 if _ps._one_device else _ps.current_device(arrays)


def _small(m, n, k):
    return 0 < m <= MAX_DIM and 0 < n <= MAX_DIM and 0 < k <= MAX_DIM and m * n * k <= MAX_MACS


def linear(x, w, bias):
    """x (..., K) @ w (N, K)^T + bias for a small problem, else None."""
    if MAX_MACS < 0 or type(x) is not _nd or type(w) is not _nd or w.ndim != 2 or not x.ndim:
        return None
    n, k = w.shape
    if x.shape[-1] != k or not k:
        return None
    m = x.size // k
    if not (0 < m <= MAX_DIM and 0 < n <= MAX_DIM and k <= MAX_DIM and m * n * k <= MAX_MACS):
        return None
    dt = x.dtype
    kind = _KIND.get(dt.num)
    if kind is None or w.dtype != dt or not (x._c_contiguous and w._c_contiguous):
        return None
    if bias is not None and (type(bias) is not _nd or bias.dtype != dt or bias.shape != (n,)
                             or not bias._c_contiguous):
        return None
    dev = _device(x, w, bias)
    if dev is None:
        return None
    out = _new_output(x.shape[:-1] + (n,), m * n, dt)
    _local.launches[("gs_gemm", kind, m, n, k, k, 1, k, 1, dev)](
        (x.data.ptr, w.data.ptr, 0 if bias is None else bias.data.ptr, out.data.ptr))
    return out


def _strides(x):
    """(row stride, column stride) in elements of a 2-D C- or F-contiguous array, else None."""
    if x._c_contiguous:
        return x.shape[1], 1
    if x._f_contiguous:
        return 1, x.shape[0]
    return None


def matmul(a, b):
    """a (M, K) @ b (K, N) for a small problem of 2-D arrays, each C- or F-contiguous (a transposed view of a
    row-major array reads in place), else None."""
    if MAX_MACS < 0 or type(a) is not _nd or type(b) is not _nd or a.ndim != 2 or b.ndim != 2:
        return None
    m, k = a.shape
    k2, n = b.shape
    if k != k2 or not _small(m, n, k):
        return None
    dt = a.dtype
    kind = _KIND.get(dt.num)
    if kind is None or b.dtype != dt:
        return None
    sa, sb = _strides(a), _strides(b)
    if sa is None or sb is None:
        return None
    dev = _device(a, b)
    if dev is None:
        return None
    out = _new_output((m, n), m * n, dt)
    # the kernel reads B as (j, r): b[r, j] at r * sb[0] + j * sb[1]
    _local.launches[("gs_gemm", kind, m, n, k, sa[0], sa[1], sb[1], sb[0], dev)](
        (a.data.ptr, b.data.ptr, 0, out.data.ptr))
    return out


def linear_grads(g, x, w, need_dx, need_dw, need_db):
    """(dx (M, K), dW (N, K), db (N,)) of a linear layer from g (M, N), x (M, K), w (N, K) in one launch, None for
    each one not asked for; None when the problem is not small (the caller's cuBLAS path)."""
    if MAX_MACS < 0 or type(g) is not _nd or g.ndim != 2 or not (need_dx or need_dw or need_db):
        return None
    m, n = g.shape
    k = 1
    dt = g.dtype
    if need_dx:
        if type(w) is not _nd or w.ndim != 2 or w.shape[0] != n or w.dtype != dt or not w._c_contiguous:
            return None
        k = w.shape[1]
    else:
        w = None
    if need_dw:
        if (type(x) is not _nd or x.ndim != 2 or x.shape[0] != m or x.dtype != dt or not x._c_contiguous
                or (need_dx and x.shape[1] != k)):
            return None
        k = x.shape[1]
    else:
        x = None
    kind = _KIND.get(dt.num)
    if kind is None or not g._c_contiguous or not _small(m, n, k):
        return None
    dev = _device(g, x, w)
    if dev is None:
        return None
    dx = _new_output((m, k), m * k, dt) if need_dx else None
    dw = _new_output((n, k), n * k, dt) if need_dw else None
    db = _new_output((n,), n, dt) if need_db else None
    _local.launches[("gs_linear_bwd", kind, m, n, k, 0, 0, 0, 0, dev)](
        (g.data.ptr, 0 if x is None else x.data.ptr, 0 if w is None else w.data.ptr, 0 if dx is None else dx.data.ptr,
         0 if dw is None else dw.data.ptr, 0 if db is None else db.data.ptr))
    return dx, dw, db
