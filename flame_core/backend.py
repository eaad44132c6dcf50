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
