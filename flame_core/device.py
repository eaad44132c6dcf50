"""Devices: `cpu` (NumPy) and `cuda` / `cuda:N` (CuPy). `FLAME_DEVICE` overrides the default."""
import contextlib
import os

from . import backend
from .errors import DeviceError


class Device:
    __slots__ = ("type", "index")

    def __init__(self, type, index=None):
        if isinstance(type, Device):
            type, index = type.type, type.index
        elif isinstance(type, str) and ":" in type:
            type, _, idx = type.partition(":")
            if not idx.isdigit():
                raise DeviceError(f"invalid device string '{type}:{idx}'; expected 'cpu', 'cuda' or 'cuda:N'")
            index = int(idx)
        if type not in ("cpu", "cuda"):
            raise DeviceError(f"unknown device type {type!r}; expected 'cpu', 'cuda' or 'cuda:N'")
        if type == "cpu":
            index = None
        elif index is None:
            index = 0
        self.type = type
        self.index = index

    def __eq__(self, other):
        if isinstance(other, str):
            other = Device(other)
        return isinstance(other, Device) and self.type == other.type and self.index == other.index

    def __hash__(self):
        return hash((self.type, self.index))

    def __repr__(self):
        return f"device(type='{self.type}'" + (f", index={self.index})" if self.index is not None else ")")

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @contextlib.contextmanager
    def context(self):
        """Make this GPU current for CuPy allocations (no-op on cpu)."""
        if self.type == "cuda":
            backend.xp_for(self)  # raises DeviceError (not AttributeError) when CuPy sees no GPU
            with backend.cupy.cuda.Device(self.index):
                yield
        else:
            yield


CPU = Device("cpu")
_cache = {"cpu": CPU}


def device(d=None):
    """Parse a device given as Device, str ('cpu', 'cuda', 'cuda:1'), int (GPU index) or None (the default)."""
    if d is None:
        return default_device()
    if isinstance(d, Device):
        return d
    if isinstance(d, int):
        d = f"cuda:{d}"
    dev = _cache.get(d)
    if dev is None:
        dev = _cache[d] = Device(d)
        if dev.type == "cuda":
            _first_cuda_use(dev)
    return dev


def _first_cuda_use(dev):
    """A cuda device named for the first time: start preparing CuPy's own kernels on a side pool (once per process;
    flame_core/kernels/cupy_warmup.py, FLAME_CUPY_WARMUP=0 turns it off). Never fails the caller."""
    if backend.cupy is None or not backend.cuda_available():
        return
    try:
        from .kernels import cupy_warmup
        cupy_warmup.start(dev.index)
    except Exception as e:  # a warm-up that cannot start leaves CuPy compiling on demand, as without it
        import warnings
        warnings.warn(f"FLAME could not start preparing CuPy's kernels ({type(e).__name__}: {e}); "
                      f"they compile on first use", RuntimeWarning, stacklevel=3)


_default = None


def default_device():
    """cuda when CuPy sees a GPU, else cpu; the FLAME_DEVICE environment variable overrides."""
    global _default
    if _default is None:
        env = os.environ.get("FLAME_DEVICE")
        if env:
            dev = device(env)
            if dev.type == "cuda" and not backend.cuda_available():
                raise DeviceError(f"FLAME_DEVICE={env} but CuPy does not see a GPU")
            _default = dev
        else:
            _default = device("cuda") if backend.cuda_available() else CPU
    return _default


def set_default_device(d):
    global _default
    _default = device(d)


def device_of_array(a):
    if backend.is_cuda_array(a):
        return device(f"cuda:{a.device.id}")
    return CPU


def cuda_is_available():
    return backend.cuda_available()
