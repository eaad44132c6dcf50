"""Parameter: a leaf Tensor a Module registers as learnable. Also the meta placeholders of `empty_init`."""
import numpy as np

from flame_core import backend
from flame_core import dtypes as D
from flame_core.device import device as _parse_device
from flame_core.device import device_of_array
from flame_core.errors import FlameError
from flame_core.tensor import Tensor

_new = object.__new__


class MetaTensorError(FlameError, RuntimeError):
    """A parameter built under `empty_init` was used before its weights were loaded."""


def meta_array(shape, np_dtype):
    """A read-only array of `shape` backed by ONE element (NaN for floats): shape and dtype, no memory."""
    np_dtype = np.dtype(np_dtype)
    cell = np.full((), np.nan if np_dtype.kind == "f" or np_dtype in (D.bfloat16.np, D.float8_e4m3fn.np) else 0,
                   dtype=np_dtype)
    return np.broadcast_to(cell, tuple(int(s) for s in shape))


class Parameter(Tensor):
    """`Parameter(tensor, requires_grad=True)`: shares `tensor`'s array (no copy) and is a leaf.

    A meta parameter (`is_meta`) holds only shape, dtype and its target device: it is created under
    `flame_nn.empty_init()` and gets real storage from `materialize_` (load_state_dict, to_empty, copy_).
    """

    _meta_device = None  # the Device a meta parameter will live on; None once it has storage

    def __new__(cls, data=None, requires_grad=True):
        p = _new(cls)
        if data is None:
            p.set_array_(np.empty((0,), dtype=D.get_default_dtype().np))
            p._version = [0]
        else:
            if not isinstance(data, Tensor):
                raise TypeError(f"Parameter expects a Tensor, got {type(data).__name__}")
            p.set_array_(data.array)
            p._version = data._version
            if data._f8:
                p._f8 = True
            md = getattr(data, "_meta_device", None)
            if md is not None:
                p._meta_device = md
        if requires_grad:
            p.requires_grad_(True)
        return p

    def __init__(self, data=None, requires_grad=True):  # all the work is in __new__ (cheap, no Tensor.__init__)
        pass

    @classmethod
    def meta(cls, shape, dtype=None, device=None, requires_grad=True):
        """A placeholder of `shape`/`dtype` for `device`, allocating nothing."""
        dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
        p = _new(cls)
        p.set_array_(meta_array(shape, dt.np))
        p._version = [0]
        p._meta_device = _parse_device(device)
        p._requires_grad = bool(requires_grad) and dt.is_floating_point
        return p

    @property
    def is_meta(self):
        return self._meta_device is not None

    @property
    def device(self):
        md = self._meta_device
        return md if md is not None else device_of_array(self.array)

    def materialize_(self, array, f8=False):
        """Give a meta (or any) parameter new storage `array` (already of the wanted dtype and device); `f8` marks
        float8 held as raw bytes in a uint8 CuPy array (the core's convention)."""
        if tuple(array.shape) != tuple(self.array.shape):
            raise MetaTensorError(f"materialize_: array of shape {tuple(array.shape)} for a parameter of shape "
                                  f"{tuple(self.array.shape)}")
        self.set_array_(array, bool(f8))
        self._version = [0]
        self._meta_device = None
        return self

    def copy_(self, src, non_blocking=False):
        if self._meta_device is not None:  # loading into a placeholder allocates it first
            self.materialize_(*empty_storage(self.array.shape, self.array.dtype, self._meta_device))
        return Tensor.copy_(self, src, non_blocking)

    def __repr__(self):
        if self._meta_device is not None:
            return (f"Parameter(meta, shape={tuple(self.shape)}, dtype={self.dtype!r}, "
                    f"device='{self._meta_device}')")
        return "Parameter containing:\n" + Tensor.__repr__(self)

    def __reduce__(self):
        if self._meta_device is not None:  # copies and pickles of a placeholder stay placeholders
            return (_rebuild_meta, (tuple(self.shape), self.dtype.name, str(self._meta_device), self._requires_grad))
        return (_rebuild_parameter, (backend.to_numpy(self.array), str(self.device), self._requires_grad))


def _rebuild_parameter(arr, dev, requires_grad):
    from flame_core import tensor
    return Parameter(tensor(arr, device=dev), requires_grad=requires_grad)


def _rebuild_meta(shape, dtype_name, dev, requires_grad):
    return Parameter.meta(shape, dtype_name, dev, requires_grad=requires_grad)


def empty_storage(shape, np_dtype, dev):
    """(uninitialised array, is_fp8_bytes) of shape/dtype on Device `dev` (float8 on cuda: uint8 bytes)."""
    xp = backend.xp_for(dev)
    f8 = dev.type == "cuda" and np.dtype(np_dtype) == D.float8_e4m3fn.np
    with dev.context():
        return xp.empty(tuple(shape), dtype=np.uint8 if f8 else np_dtype), f8


def is_meta(t):
    return getattr(t, "_meta_device", None) is not None
