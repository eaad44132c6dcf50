"""The two array modules: NumPy for `cpu`, CuPy for `cuda`. Ops are written once against `xp`."""
import os

import numpy as np

try:  # CuPy is optional: without it (or without a GPU) everything runs on NumPy.
    import cupy  # noqa: F401
except Exception:  # pragma: no cover - depends on the machine
    cupy = None

_cuda_ok = None


def cuda_available():
    """True when CuPy imports and sees at least one GPU."""
    global _cuda_ok
    if _cuda_ok is None:
        _cuda_ok = False
        if cupy is not None:
            try:
                _cuda_ok = cupy.cuda.runtime.getDeviceCount() > 0
            except Exception:
                _cuda_ok = False
    return _cuda_ok


def cuda_device_count():
    return cupy.cuda.runtime.getDeviceCount() if cuda_available() else 0


_cupy_ndarray = cupy.ndarray if cupy is not None else ()


def is_cuda_array(a):
    return cupy is not None and isinstance(a, _cupy_ndarray)


def copy_array(a):
    """A C-contiguous copy of array `a`. A C-contiguous CUDA array is copied with one cudaMemcpyAsync on the current
    stream (capturable in a CUDA graph): CuPy's elementwise copy kernel moves bfloat16 at about a fifth of the
    memory bandwidth."""
    if cupy is not None and isinstance(a, _cupy_ndarray) and a.flags.c_contiguous:
        with a.device:
            out = cupy.empty(a.shape, dtype=a.dtype)
            if a.nbytes:
                out.data.copy_from_device_async(a.data, a.nbytes)
        return out
    return a.copy()


def copy_into(dst, src):
    """dst[...] = src; one cudaMemcpyAsync where both are C-contiguous CUDA arrays of one shape, dtype and device."""
    if (cupy is not None and isinstance(dst, _cupy_ndarray) and isinstance(src, _cupy_ndarray)
            and dst.shape == src.shape and dst.dtype == src.dtype and dst.flags.c_contiguous
            and src.flags.c_contiguous and dst.device == src.device):
        if dst.nbytes:
            with dst.device:
                dst.data.copy_from_device_async(src.data, src.nbytes)
        return
    dst[...] = src


def xp_of(a):
    """Array module (numpy or cupy) of an array."""
    return cupy if (cupy is not None and isinstance(a, _cupy_ndarray)) else np


def xp_for(device):
    """Array module for a Device."""
    if device.type == "cuda":
        if not cuda_available():
            from .errors import DeviceError
            raise DeviceError(f"device {device} requested but CuPy does not see a GPU "
                              f"(install flame-diffusion[cuda12] or flame-diffusion[cuda13] on a machine with one)")
        return cupy
    return np


def to_numpy(a):
    """A NumPy array holding the data of `a` (copying from the GPU when needed)."""
    if cupy is not None and isinstance(a, _cupy_ndarray):
        return cupy.asnumpy(a)
    return np.asarray(a)


def env_flag(name, default=True):
    v = os.environ.get(name)
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off", "")


def env_positive_int(name):
    """The positive integer in environment variable `name`, or None when it is unset or blank; ValueError naming
    the variable for anything else."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return n
