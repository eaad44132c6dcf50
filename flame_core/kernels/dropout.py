"""dropout on cuda in one kernel: cuda_src/philox.cu's philox_dropout draws the uniforms, keeps each element with
probability 1 - p and writes both the output and the mask (the backward's factor, 0 or 1 / (1 - p) in the input's
dtype) in one pass, where the composed path ran five (a draw, a comparison, a cast, a scale, a product).

The uniforms are those a `rand` of the input's shape in float32 draws at the same (seed, offset) -- the caller
reserves the offsets as that draw would (random._CudaPhilox.reserve) -- and every value is the composed path's:
the same mask, the same output bits.

    dropout(x, p, seed, offset)         (y, mask) for a C-contiguous cupy float32 / float16 / bfloat16 array x;
                                        None where this does not apply (the caller composes the ops)
"""
import ml_dtypes
import numpy as np

from .. import backend
from . import launching, loader, plans

BLOCK = 256
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_KIND = {d.num: k for k, d in enumerate(_DTYPES)}
_nd = backend._cupy_ndarray if backend.cupy is not None else None
_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None
_LAUNCHES = launching.LaunchCache(256)   # (dtype kind, element count, p) -> the PackedLaunch (x, y, mask, seed and
# offset are its per-call arguments), per thread and device


def _launch(kind, n, p):
    key = (kind, n, p)
    pl = _LAUNCHES.get(key)
    if pl is None:
        kernel = loader.get_function("philox", "philox_dropout", _DTYPES[kind])
        blocks = plans.cdiv(plans.cdiv(n, 4), BLOCK)
        scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)   # the survivors' factor (the composed path's)
        pl = _LAUNCHES.put(key, launching.PackedLaunch(
            kernel, (blocks,), (BLOCK,), (None,) * 5 + (np.int64(n), np.float32(p), np.float32(scale)), 5))
    return pl


def applies(x):
    """Whether `dropout` runs for the array x (a non-empty C-contiguous cupy array of a kernel dtype on the current
    device, kernels enabled)."""
    return (type(x) is _nd and x.dtype.num in _KIND and x._c_contiguous and x.size > 0
            and x.data.device_id == _get_device() and loader.use_kernel(x))


def dropout(x, p, seed, offset):
    """(y, mask) of dropout at rate p on the cupy array x (see the module's docstring): keep where the uniform of
    element i at (seed, offset) is >= float32(p); mask = dtype(1 / (1 - p)) there (0 for p = 1), else 0; y = x * mask.
    The caller checked `applies(x)` and reserved ceil(n / 4) * 4 offsets."""
    kind = _KIND[x.dtype.num]
    y = _nd(x.shape, x.dtype)
    mask = _nd(x.shape, x.dtype)
    _launch(kind, x.size, p)((x.data.ptr, y.data.ptr, mask.data.ptr, seed, offset))
    return y, mask
