"""FLAME memory: the caching device pool (CuPy's allocator on cuda), cpu tensor-storage accounting, a limit,
a pinned host pool and a memory profiler. PyTorch's names:

    memory_allocated(device=None)      bytes in live blocks (cuda) / live tensor storage (cpu: accounted from the
                                       first use of any of these functions for cpu on, see memory.cpu_tracking)
    memory_reserved(device=None)       bytes the pool holds from the device (cpu: == allocated)
    max_memory_allocated / max_memory_reserved / reset_peak_memory_stats
    memory_stats(device=None)          dict: allocated/reserved current+peak, alloc/free counts, cache hits/misses,
                                       device mallocs/frees, splits/merges, retries, OOMs, per size class
    memory_summary(device=None)        readable table
    empty_cache(device=None)           give cached segments back to the device
    set_memory_limit(nbytes, device=None)   cap (None removes it); over it: free cache, retry, OutOfMemoryError
    pinned_empty(shape, dtype)         cpu Tensor on pooled page-locked memory
    MemoryProfiler                     timeline of (op, allocated, reserved) and the owners of the peak

`device=None` means the default device. Importing this package installs the pool as CuPy's allocator when CuPy
sees a GPU (FLAME_CUDA_POOL=0 leaves CuPy's own pool in place; the cuda stats are then unavailable).
"""
import os
import sys

from .. import backend as _backend
from ..device import device as _parse_device
from ..errors import DeviceError, OutOfMemoryError
from . import cpu_tracking
from . import stats as _stats
from .pinned import pinned_pool
from .pool import DevicePool, round_size
from .profiler import MemoryProfiler
from .tracking import is_tracking, set_tracking

_tensor = sys.modules["flame_core.tensor"]  # the module: the attribute flame_core.tensor is the function
cpu_tracking._install_hook()  # cpu storage is accounted from the first read of its figures on (cpu_tracking.enable)

_cuda_pool_enabled = os.environ.get("FLAME_CUDA_POOL", "1").strip().lower() not in ("0", "false", "no", "off")
if _cuda_pool_enabled and _backend.cuda_available():
    from . import cuda as _cuda
    _cuda.install()


def _accountant(device=None):
    dev = _parse_device(device)
    if dev.type == "cpu":
        if not cpu_tracking._on:
            cpu_tracking.enable()
        return cpu_tracking.T
    if not _backend.cuda_available():
        raise DeviceError(f"memory statistics for {dev} requested but CuPy does not see a GPU")
    from . import cuda
    if not cuda.is_installed():
        raise DeviceError(f"memory statistics for {dev} need FLAME's CUDA pool, which is not installed "
                          f"(FLAME_CUDA_POOL=0 or flame_core.memory.cuda.uninstall() was called)")
    return cuda.pool_for(dev.index)


def memory_allocated(device=None):
    return _accountant(device).allocated


def memory_reserved(device=None):
    return _accountant(device).reserved


def max_memory_allocated(device=None):
    return _accountant(device).peak_allocated


def max_memory_reserved(device=None):
    return _accountant(device).peak_reserved


def reset_peak_memory_stats(device=None):
    _accountant(device).reset_peak()


def memory_stats(device=None):
    return _stats.stats_dict(_accountant(device))


def memory_summary(device=None):
    dev = _parse_device(device)
    return _stats.summary(_accountant(dev), str(dev))


def empty_cache(device=None):
    """Release cached (free) memory to the device. Returns the bytes released."""
    return _accountant(device).empty_cache()


def set_memory_limit(nbytes, device=None):
    """Cap the device's memory (reserved bytes on cuda, tensor storage on cpu): an int, a string such as '24GiB',
    or None to remove the cap."""
    _accountant(device).set_limit(_stats.parse_size(nbytes))


def get_memory_limit(device=None):
    return _accountant(device).limit


def pinned_empty(shape, dtype=None):
    """An uninitialised cpu Tensor on page-locked memory from the pinned pool (pageable when there is no GPU)."""
    from .. import dtypes as D
    if isinstance(shape, int):
        shape = (shape,)
    dt = D.get_default_dtype() if dtype is None else D.dtype(dtype)
    return _tensor._wrap(pinned_pool().empty(tuple(int(s) for s in shape), dt.np))


def is_pinned(t):
    """True when the Tensor (or NumPy array) lies on the pinned pool's page-locked memory."""
    arr = t._data if isinstance(t, _tensor.Tensor) else t
    pool = pinned_pool()
    return pool.backend.pinned and pool.owns(arr)


def pinned_memory_stats():
    return _stats.stats_dict(pinned_pool())


def empty_pinned_cache():
    return pinned_pool().empty_cache()


__all__ = ["memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
           "reset_peak_memory_stats", "memory_stats", "memory_summary", "empty_cache", "set_memory_limit",
           "get_memory_limit", "pinned_empty", "is_pinned", "pinned_memory_stats", "empty_pinned_cache",
           "MemoryProfiler", "OutOfMemoryError", "set_tracking", "is_tracking", "DevicePool", "round_size"]
