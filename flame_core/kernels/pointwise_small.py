"""Pointwise ops on small contiguous cuda arrays through cuda_src/pointwise_small.cu, for the per-op host cost.

On arrays of a few thousand elements the GPU is idle and an op's cost is the host's: a CuPy ufunc spends ~13 us in
its dispatch, a `launching.launch` ~15 us converting arguments. Here each (kernel, dtype, numel, device) gets one
`launching.PackedLaunch` per thread whose only per-call work is writing the array addresses (and the scalar's bits) into
its packed argument buffer and one driver launch; the output is a bare `cupy.ndarray(shape, dtype)`.

API: each returns a new cupy array, or None when the fast path does not apply (not a CuPy array, not C-contiguous,
more than MAX_NUMEL elements, a dtype other than float32/float16/bfloat16, kernels disabled or a `loader.reference()`
block, operands on another device than the current one) -- the caller then runs its CuPy/NumPy path.

``fast_scalar(op, x, s, out=None)``  op: "mul" (x*s), "add" (x+s), "sub" (x-s), "rsub" (s-x); s a Python float or
                            int, taken in float32 (PyTorch's arithmetic for half-precision tensors and a Python
                            scalar). `out` (x's shape and dtype, may be x): written in place and returned.
``fast_binary(op, a, b, out=None)``  op: "mul", "add", "sub"; a, b of one shape and dtype. `out` (same shape and
                            dtype, may be `a`): written in place and returned (the engine's gradient accumulation).
``fast_unary(op, x)``       op: "neg", "tanh".
``fast_clamp(x, lo, hi)``, ``fast_clamp_grad(g, x, lo, hi)``  clamp and its backward with Python float / int bounds
                            (None: unbounded), the bounds rounded to x's dtype (as CuPy's maximum / minimum and
                            comparisons take them).
``fast_grad(kernel, g, s, out=None)``  the first-order backward rules of cuda_src/pointwise_grad.cu ("tanh_bwd",
                            "sigmoid_bwd", "relu_bwd", "sqrt_bwd", "rsqrt_bwd", "abs_bwd") on small arrays, its
                            own kernels through a packed launch; `out` may be g (a backward's in-place result).

Math in fp32, one rounding to the dtype: float32 results are bit-identical to CuPy's ufuncs for mul/add/sub/neg (one
IEEE operation); for float16/bfloat16 operands one fp32 operation rounded once is the correctly rounded result (fp32
carries more than twice their precision plus two bits), and a Python scalar enters in float32, as PyTorch takes it.
tanh uses tanhf as CuPy's float tanh does.
"""
import math
import os
import threading

import ml_dtypes
import numpy as np

from .. import backend, speedups
from ..memory import recycle
from . import launching, loader, plans

# above this CuPy's ufuncs run (their per-call cost no longer matters next to the work); FLAME_SMALL_POINTWISE=0
# switches the fast path off (A/B measurements)
MAX_NUMEL = 65536 if os.environ.get("FLAME_SMALL_POINTWISE", "1") != "0" else -1
BLOCK = 256
STEM = "pointwise_small"

_nd = backend._cupy_ndarray if backend.cupy is not None else None
# outputs from the bin of small dead arrays while it is on (memory.recycle); tested with `is None`, never `or`: an
# array's truth is its values
_rc_on, _rc_take = recycle.on, recycle.take
# dtype.num -> index into _DTYPES (the kernel dtypes); bfloat16's number is assigned when ml_dtypes registers it
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_KIND = {d.num: k for k, d in enumerate(_DTYPES)}
_F32_MAX = float(np.finfo(np.float32).max)

_SCALAR = {"mul": "pws_mul_scalar", "add": "pws_add_scalar", "sub": "pws_sub_scalar", "rsub": "pws_rsub_scalar"}
_BINARY = {"mul": "pws_mul", "add": "pws_add", "sub": "pws_sub"}
_UNARY = {"neg": "pws_neg", "tanh": "pws_tanh"}
_UNARY_NAMES = frozenset(_UNARY.values())
# the dynamic (per-call) arguments of each kernel: x, out (unary); a, b, out (binary, scalar: x, out, bits); clamp:
# x, out and the two bounds' bits; its backward: g, x, out and the bounds
_DYNAMIC = dict.fromkeys(_UNARY_NAMES, 2)
_DYNAMIC.update(pws_clamp=4, pws_clamp_bwd=5)
# the fused backward rules are cuda_src/pointwise_grad.cu's own kernels (g, s, out, int64 n; grid-stride loop)
_GRAD = frozenset(("tanh_bwd", "sigmoid_bwd", "relu_bwd", "sqrt_bwd", "rsqrt_bwd", "abs_bwd"))

_bits = ({}, {}, {})  # per kind: Python scalar -> float32 bit pattern of the scalar rounded to that dtype
_CUPY_FLAG_ATTR = _nd is not None and hasattr(_nd, "_c_contiguous")


def _contiguous(a):
    return a._c_contiguous if _CUPY_FLAG_ATTR else a.flags.c_contiguous


def _scalar_bits(kind, s):
    """The raw `float` slot value of s in float32 (as PyTorch computes a half-precision tensor with a Python scalar:
    in float32, one rounding of the result), or None (an int not exact in float32, a float beyond float32: the
    reference path decides what happens)."""
    if type(s) is int and abs(s) > 1 << 24:
        return None
    f = float(s)
    if math.isfinite(f) and abs(f) > _F32_MAX:
        return None
    r = float(np.float32(f))
    b = launching.f32_bits(r)
    if f != 0.0:  # 0.0 == -0.0 == 0 as dict keys: zeros are not cached (their bit patterns differ)
        table = _bits[kind]
        if len(table) > 4096:  # many distinct scalars (a schedule): keep the table small
            table.clear()
        table[s] = b
    return b


class _Launches(dict):
    """This thread's PackedLaunches by (kernel name, dtype kind, element count, device): a miss builds the launch
    (`__missing__`), so the per-op callers index the dict and run no frame of their own for it. The dynamic
    arguments are the first two (unary kernels: x, out) or three; the last is n (int32 in pointwise_small.cu, int64 in
    pointwise_grad.cu, whose kernels loop over a grid of at most 8192 blocks)."""

    def __missing__(self, key):
        name, kind, n, dev = key
        if len(self) >= 4096:  # many distinct sizes: rebuild on demand rather than grow without bound
            self.clear()
        grad = name in _GRAD
        n_dynamic = _DYNAMIC.get(name, 3)
        kernel = loader.get_function("pointwise_grad" if grad else STEM, name, _DTYPES[kind])
        blocks = plans.cdiv(n, BLOCK)
        pl = self[key] = launching.PackedLaunch(kernel, (min(blocks, 8192) if grad else blocks,), (BLOCK,),
                                                (None,) * n_dynamic + ((np.int64 if grad else np.int32)(n),),
                                                n_dynamic)
        return pl


class _Local(threading.local):
    def __init__(self):  # runs once in each thread that touches it
        self.launches = _Launches()


_local = _Local()  # a packed buffer is rewritten per call: one set of launches per thread


def _ready(x, *others):
    """(dtype kind, device) when x and `others` are small C-contiguous cuda arrays of x's shape and dtype on the
    current device and kernels are enabled; None otherwise (the caller's own path runs). The per-op hot path: the
    checks are inlined (no helper frames): loader.enabled() is read from its cached state while FLAME_KERNELS keeps
    the value last parsed and no reference() block is open (else it is called), and the device checks are skipped
    once the process is known to see one GPU (every cuda array is then on the current device, 0)."""
    if type(x) is not _nd or x.size > MAX_NUMEL or not (x._c_contiguous if _CUPY_FLAG_ATTR else _contiguous(x)):
        return None
    dt = x.dtype
    for o in others:
        if (type(o) is not _nd or o.shape != x.shape or (o.dtype is not dt and o.dtype != dt)
                or not (o._c_contiguous if _CUPY_FLAG_ATTR else _contiguous(o))):
            return None
    kind = _KIND.get(dt.num)
    if kind is None:
        return None
    st = _kstate
    if (st[2] or not st[1] or _env_get(_KERNELS_KEY) is not st[0] or backend._cuda_ok is not True) \
            and not loader.enabled():
        return None
    if _one_device:
        return kind, 0
    dev = current_device((x,) + others)  # (several GPUs, or not known yet)
    return None if dev is None else (kind, dev)


def kernels_ready():
    """loader.enabled() read from its cached state while that state holds (_ready's inline test, as a call for the
    other small-array paths)."""
    st = _kstate
    return (not (st[2] or not st[1] or _env_get(_KERNELS_KEY) is not st[0] or backend._cuda_ok is not True)
            or loader.enabled())


def current_device(arrays):
    """The current device when every cuda array of `arrays` (None entries aside) lives on it, else None; notes when
    the process sees a single GPU (then `_one_device` is True: every cuda array is on device 0, the current one, and
    the per-op callers skip this check). Shared by the small-array paths (gemm_small too)."""
    global _one_device
    dev = _get_device()  # the current device: every array must live on it
    for a in arrays:
        if a is not None and a.data.device_id != dev:
            return None
    if _one_device is None:
        _one_device = backend.cuda_device_count() == 1
    return dev


_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None
_kstate = loader._state  # [raw FLAME_KERNELS last parsed, its flag, reference() blocks open] (see loader.enabled)
_env_get = loader._env_data.get if loader._env_data is not None else (lambda key: None)  # None: never the key
_KERNELS_KEY = getattr(loader, "_KERNELS_KEY", None)
_one_device = None  # whether the process sees a single GPU (None: not yet known; the first device check sets it)


def fast_scalar(op, x, s, out=None):
    """x OP s (op: mul, add, sub; rsub: s - x) for a small contiguous cuda array x and a Python float/int s; into
    `out` when given (x itself, or an array of x's shape and dtype)."""
    ts = type(s)
    if ts is not float and ts is not int:
        return None
    ready = _ready(x) if out is None or out is x else _ready(x, out)
    if ready is None:
        return None
    kind, dev = ready
    bits = _bits[kind].get(s)
    if bits is None:
        bits = _scalar_bits(kind, s)
        if bits is None:
            return None
    if out is None:
        out = _rc_take(x.shape, x.dtype) if _rc_on[0] else None
        if out is None:
            out = _nd(x.shape, x.dtype)
    n = x.size
    if n:
        _local.launches[(_SCALAR[op], kind, n, dev)].launch3(x.data.ptr, out.data.ptr, bits)
    return out


def fast_binary(op, a, b, out=None):
    """a OP b (op: mul, add, sub) for small contiguous cuda arrays of one shape and dtype; into `out` when given
    (`out` may be `a`: the engine's in-place gradient accumulation)."""
    ready = _ready(a, b) if out is None or out is a else _ready(a, b, out)
    if ready is None:
        return None
    kind, dev = ready
    if out is None:
        out = _rc_take(a.shape, a.dtype) if _rc_on[0] else None
        if out is None:
            out = _nd(a.shape, a.dtype)
    n = a.size
    if n:
        _local.launches[(_BINARY[op], kind, n, dev)].launch3(a.data.ptr, b.data.ptr, out.data.ptr)
    return out


def fast_unary(op, x):
    """neg / tanh of a small contiguous cuda array."""
    ready = _ready(x)
    if ready is None:
        return None
    kind, dev = ready
    out = _rc_take(x.shape, x.dtype) if _rc_on[0] else None
    if out is None:
        out = _nd(x.shape, x.dtype)
    n = x.size
    if n:
        _local.launches[(_UNARY[op], kind, n, dev)].launch2(x.data.ptr, out.data.ptr)
    return out


def fast_grad(kernel, g, s, out=None):
    """A fused first-order backward rule of cuda_src/pointwise_grad.cu (`kernel`, e.g. "tanh_bwd") on small
    contiguous cuda arrays g (upstream gradient) and s (the saved tensor) of one shape and dtype; into `out` when
    given (g itself: a backward that holds its gradient alone)."""
    if kernel not in _GRAD:
        return None
    ready = _ready(g, s) if out is None or out is g else _ready(g, s, out)
    if ready is None:
        return None
    kind, dev = ready
    if out is None:
        out = _rc_take(g.shape, g.dtype) if _rc_on[0] else None
        if out is None:
            out = _nd(g.shape, g.dtype)
    n = g.size
    if n:
        _local.launches[(kernel, kind, n, dev)].launch3(g.data.ptr, s.data.ptr, out.data.ptr)
    return out


def _bound_bits(kind, v, default):
    """The float32 bits of a clamp bound rounded to the dtype of `kind` (default: the missing bound's infinity), or
    None for a bound the kernel does not take (not a Python float / int, an int not exact in float32)."""
    if v is None:
        v = default
    elif type(v) is int:
        if abs(v) > 1 << 24:
            return None
    elif type(v) is not float:
        return None
    return launching.f32_bits(float(np.asarray(v, dtype=_DTYPES[kind])))


def fast_clamp(x, lo, hi):
    """np.minimum(np.maximum(x, lo), hi) of a small contiguous cuda array and Python float / int bounds (None: that
    side unbounded), the bounds rounded to x's dtype as the ufuncs take them; None where this does not apply."""
    ready = _ready(x)
    if ready is None:
        return None
    return _clamp_launch("pws_clamp", ready, x, (x.data.ptr,), lo, hi)


def fast_clamp_grad(g, x, lo, hi):
    """clamp's backward g * (lo <= x <= hi) on small contiguous cuda arrays of one shape and dtype (bounds as in
    fast_clamp); None where this does not apply."""
    ready = _ready(g, x)
    if ready is None:
        return None
    return _clamp_launch("pws_clamp_bwd", ready, g, (g.data.ptr, x.data.ptr), lo, hi)


def _clamp_launch(name, ready, like, inputs, lo, hi):
    """The clamp kernels' launch: a new output of `like`'s shape and dtype, written by kernel `name` from the input
    addresses and the bounds' bits; None for bounds the kernel does not take."""
    kind, dev = ready
    lb, hb = _bound_bits(kind, lo, -math.inf), _bound_bits(kind, hi, math.inf)
    if lb is None or hb is None:
        return None
    out = _rc_take(like.shape, like.dtype) if _rc_on[0] else None
    if out is None:
        out = _nd(like.shape, like.dtype)
    n = like.size
    if n:
        _local.launches[(name, kind, n, dev)](inputs + (out.data.ptr, lb, hb))
    return out


def cached_launches():
    """How many PackedLaunches this thread holds (tests: the second call of a shape reuses the first's)."""
    return len(_local.launches)


# the four per-op entry points in C where the extension is built (flame_core/csrc/pointwise.c: these functions with
# the same checks and results, launching the same PackedLaunches); the Python ones stay the specification and the
# fallback (flame_core.speedups)
py_fast_scalar, py_fast_binary, py_fast_unary, py_fast_grad = fast_scalar, fast_binary, fast_unary, fast_grad
_c = speedups.module
if _c is not None:
    _c.configure_pointwise(globals(), vars(launching))
    fast_scalar, fast_binary, fast_unary, fast_grad = _c.fast_scalar, _c.fast_binary, _c.fast_unary, _c.fast_grad
