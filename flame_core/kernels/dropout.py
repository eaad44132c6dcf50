"""dropout on cuda in one kernel: cuda_src/philox.cu's philox_dropout draws the uniforms, keeps each element with
probability 1 - p and writes both the output and the mask (the backward's factor, 0 or 1 / (1 - p) in the input's
dtype) in one pass, where the composed path ran five (a draw, a comparison, a cast, a scale, a product).

The uniforms are those a `rand` of the input's shape in float32 draws at the same (seed, offset) -- the caller
reserves the offsets as that draw would (random._CudaPhilox.reserve) -- and every value is the composed path's:
the same mask, the same output bits.

    dropout(x, p, scale, seed, offset)  (y, mask) for a C-contiguous cupy float32 / float16 / bfloat16 array x;
                                        None where this does not apply (the caller composes the ops)
"""
import threading

import ml_dtypes
import numpy as np

from .. import backend
from . import launching, loader, plans

BLOCK = 256
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_KIND = {d.num: k for k, d in enumerate(_DTYPES)}
_nd = backend._cupy_ndarray if backend.cupy is not None else None
_get_device = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else None


class _Launches(dict):
    """This thread's PackedLaunches by (dtype kind, element count, p, scale, device); the dynamic slots are x, y,
    mask, seed and offset."""

    def __missing__(self, key):
        kind, n, p, scale, dev = key
        if len(self) >= 256:  # many distinct sizes or rates: rebuild on demand rather than grow without bound
            self.clear()
        kernel = loader.get_function("philox", "philox_dropout", _DTYPES[kind])
        blocks = plans.cdiv(plans.cdiv(n, 4), BLOCK)
        pl = self[key] = launching.PackedLaunch(
            kernel, (blocks,), (BLOCK,), (None,) * 5 + (np.int64(n), np.float32(p), np.float32(scale)), 5)
        return pl


class _Local(threading.local):
    def __init__(self):
        self.launches = _Launches()


_local = _Local()


def applies(x):
    """Whether `dropout` runs for the array x (a non-empty C-contiguous cupy array of a kernel dtype on the current
    device, kernels enabled)."""
    return (type(x) is _nd and x.dtype.num in _KIND and x._c_contiguous and x.size > 0
            and x.data.device_id == _get_device() and loader.use_kernel(x))


def dropout(x, p, scale, seed, offset):
    """(y, mask) of dropout at rate p on the cupy array x (see the module's docstring): keep where the uniform of
    element i at (seed, offset) is >= float32(p); mask = dtype(scale) there, else 0; y = x * mask. The caller checked
    `applies(x)` and reserved ceil(n / 4) * 4 offsets."""
    kind = _KIND[x.dtype.num]
    y = _nd(x.shape, x.dtype)
    mask = _nd(x.shape, x.dtype)
    _local.launches[(kind, x.size, p, scale, _get_device())]((x.data.ptr, y.data.ptr, mask.data.ptr, seed, offset))
    return y, mask
