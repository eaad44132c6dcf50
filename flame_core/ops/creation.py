"""Constructors with PyTorch names: tensor, zeros, ones, full, empty, arange, linspace, eye, rand*, *_like."""
import numbers

import numpy as np

from .. import backend
from .. import dtypes as D
from .. import random as _random
from ..device import default_device
from ..device import device as _parse_device
from ..errors import DTypeError
from ..tensor import Tensor, _cupy_ndarray, _wrap


def _shape(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def _infer_dtype(data):
    """PyTorch's inference: bools -> bool, ints -> int64, floats -> default float."""
    if isinstance(data, bool):
        return D.bool_
    if isinstance(data, numbers.Integral):
        return D.int64
    if isinstance(data, numbers.Real):
        return D.get_default_dtype()
    a = np.asarray(data)
    if a.dtype == np.bool_:
        return D.bool_
    if a.dtype.kind in "iu":
        return D.int64
    if a.dtype.kind == "f":
        return D.get_default_dtype()
    raise DTypeError(f"cannot infer a dtype for data of type {type(data).__name__} (array dtype {a.dtype})")


def _array_from(data, dtype, device):
    dev = _parse_device(device)
    xp = backend.xp_for(dev)
    if isinstance(data, Tensor):
        data = data._data
    if backend.is_cuda_array(data) or isinstance(data, np.ndarray):
        dt = D.dtype(dtype).np if dtype is not None else data.dtype
        if dt not in D._BY_NP:
            raise DTypeError(f"unsupported array dtype {data.dtype}")
    else:
        dt = (D.dtype(dtype) if dtype is not None else _infer_dtype(data)).np
    with dev.context():
        if xp is np:
            arr = np.array(backend.to_numpy(data) if backend.is_cuda_array(data) else data, dtype=dt)
        else:
            arr = xp.array(data if backend.is_cuda_array(data) else np.asarray(data), dtype=dt)
    return arr


def _cuda_fp8(data, dtype, device):
    """True when the result is float8 on cuda (asked for, or inherited from fp8 data)."""
    if dtype is not None:
        is_f8 = D.dtype(dtype) is D.float8_e4m3fn
    elif isinstance(data, Tensor):
        is_f8 = data.dtype is D.float8_e4m3fn
    else:
        is_f8 = isinstance(data, np.ndarray) and data.dtype == D.float8_e4m3fn.np
    return is_f8 and _parse_device(device).type == "cuda"


def tensor(data, *, dtype=None, device=None, requires_grad=False):
    """A new tensor copying `data` (nested lists, scalars, NumPy/CuPy arrays or tensors)."""
    if _cuda_fp8(data, dtype, device):  # CuPy has no fp8 dtype: build on the host, move the e4m3 bytes
        host = data.cpu() if isinstance(data, Tensor) else data
        t = tensor(host, dtype=dtype, device="cpu").to(_parse_device(device))
        return t.requires_grad_(True) if requires_grad else t  # (refused for float8, with the reason)
    t = _wrap(_array_from(data, dtype, device))
    if requires_grad:
        t.requires_grad_(True)
    return t


def as_tensor(data, dtype=None, device=None):
    """Like tensor, but shares memory with a NumPy/CuPy array (or tensor) when dtype and device already match: for
    an array with neither given, a tensor over that very array (`Tensor.array` is the way back)."""
    if dtype is None and device is None and (type(data) is np.ndarray or type(data) is _cupy_ndarray):
        return _wrap(data)  # the common case, without the device parsing below
    if isinstance(data, Tensor):
        if (dtype is None or D.dtype(dtype) == data.dtype) and (device is None or
                                                               _parse_device(device) == data.device):
            return data
        return data.to(device=device, dtype=dtype)
    if isinstance(data, np.ndarray) or backend.is_cuda_array(data):
        dev = _parse_device(device) if device is not None else (
            _parse_device("cpu") if isinstance(data, np.ndarray) else _parse_device(f"cuda:{data.device.id}"))
        same_dev = (dev.type == "cuda") == backend.is_cuda_array(data)
        if same_dev and (dtype is None or D.dtype(dtype).np == data.dtype):
            return _wrap(data)
    return tensor(data, dtype=dtype, device=device)


def from_numpy(a):
    """A cpu tensor sharing memory with the NumPy array `a`."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected np.ndarray, got {type(a).__name__}")
    D.dtype_of(a.dtype)
    return _wrap(a)


def _fill(size, value, dtype, device, requires_grad, fn):
    if _cuda_fp8(None, dtype, device):
        return _fill(size, value, D.float32, device, False, fn).to(D.float8_e4m3fn)
    dev = _parse_device(device)
    dt = D.dtype(dtype) if dtype is not None else (
        _infer_dtype(value) if value is not None else D.get_default_dtype())
    xp = backend.xp_for(dev)
    with dev.context():
        arr = fn(xp, _shape(size), dt.np)
    t = _wrap(arr)
    if requires_grad:
        t.requires_grad_(True)
    return t


def zeros(*size, dtype=None, device=None, requires_grad=False):
    return _fill(size, None, dtype, device, requires_grad, lambda xp, s, d: xp.zeros(s, dtype=d))


def ones(*size, dtype=None, device=None, requires_grad=False):
    return _fill(size, None, dtype, device, requires_grad, lambda xp, s, d: xp.ones(s, dtype=d))


def empty(*size, dtype=None, device=None, requires_grad=False):
    return _fill(size, None, dtype, device, requires_grad, lambda xp, s, d: xp.empty(s, dtype=d))


def full(size, fill_value, *, dtype=None, device=None, requires_grad=False):
    if isinstance(fill_value, Tensor):
        fill_value = fill_value.item()
    return _fill((size,) if isinstance(size, int) else tuple(size), fill_value, dtype, device, requires_grad,
                 lambda xp, s, d: xp.full(s, fill_value, dtype=d))


def _like(t, dtype, device):
    return (dtype if dtype is not None else t.dtype), (device if device is not None else t.device)


def zeros_like(t, *, dtype=None, device=None, requires_grad=False):
    dt, dev = _like(t, dtype, device)
    return zeros(t.shape, dtype=dt, device=dev, requires_grad=requires_grad)


def ones_like(t, *, dtype=None, device=None, requires_grad=False):
    dt, dev = _like(t, dtype, device)
    return ones(t.shape, dtype=dt, device=dev, requires_grad=requires_grad)


def empty_like(t, *, dtype=None, device=None, requires_grad=False):
    dt, dev = _like(t, dtype, device)
    return empty(t.shape, dtype=dt, device=dev, requires_grad=requires_grad)


def full_like(t, fill_value, *, dtype=None, device=None, requires_grad=False):
    dt, dev = _like(t, dtype, device)
    return full(t.shape, fill_value, dtype=dt, device=dev, requires_grad=requires_grad)


def arange(start, end=None, step=1, *, dtype=None, device=None, requires_grad=False):
    if end is None:
        start, end = 0, start
    if dtype is None:
        dtype = D.int64 if all(isinstance(v, numbers.Integral) for v in (start, end, step)) else \
            D.get_default_dtype()
    dev = _parse_device(device)
    xp = backend.xp_for(dev)
    dt = D.dtype(dtype)
    with dev.context():
        arr = xp.arange(start, end, step, dtype=np.float64 if dt.is_floating_point else np.int64).astype(dt.np)
    t = _wrap(arr)
    return t.requires_grad_(True) if requires_grad else t


def linspace(start, end, steps, *, dtype=None, device=None, requires_grad=False):
    dev = _parse_device(device)
    xp = backend.xp_for(dev)
    dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
    with dev.context():
        arr = xp.linspace(start, end, int(steps), dtype=np.float64).astype(dt.np)
    t = _wrap(arr)
    return t.requires_grad_(True) if requires_grad else t


def logspace(start, end, steps, base=10.0, *, dtype=None, device=None, requires_grad=False):
    """base ** linspace(start, end, steps), computed in float64 and rounded once to dtype (as torch.logspace)."""
    dev = _parse_device(device)
    xp = backend.xp_for(dev)
    dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
    with dev.context():
        arr = (float(base) ** xp.linspace(start, end, int(steps), dtype=np.float64)).astype(dt.np)
    t = _wrap(arr)
    return t.requires_grad_(True) if requires_grad else t


def eye(n, m=None, *, dtype=None, device=None, requires_grad=False):
    dev = _parse_device(device)
    xp = backend.xp_for(dev)
    dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
    with dev.context():
        arr = xp.eye(n, m, dtype=dt.np)
    t = _wrap(arr)
    return t.requires_grad_(True) if requires_grad else t


def _gen(generator, device):
    if generator is not None:
        return generator
    return _random.default_generator(_parse_device(device) if device is not None else default_device())


def _random_tensor(draw, size, dtype, device, generator, requires_grad):
    dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
    if not dt.is_floating_point:
        raise DTypeError(f"random floating point numbers need a floating dtype, got {dt}")
    g = _gen(generator, device)
    dev = g.device if device is None else _parse_device(device)
    with dev.context():
        arr = draw(g, _shape(size), dt.np)
        if (dev.type == "cuda") != backend.is_cuda_array(arr):  # a generator of another device: move the draw
            arr = backend.xp_for(dev).asarray(backend.to_numpy(arr))
        if arr.dtype != dt.np:
            arr = arr.astype(dt.np)
    t = _wrap(arr)
    return t.requires_grad_(True) if requires_grad else t


def randn(*size, generator=None, dtype=None, device=None, requires_grad=False):
    return _random_tensor(lambda g, s, d: g._normal(s, d), size, dtype, device, generator, requires_grad)


def rand(*size, generator=None, dtype=None, device=None, requires_grad=False):
    return _random_tensor(lambda g, s, d: g._uniform(s, d), size, dtype, device, generator, requires_grad)


def randint(low=0, high=None, size=None, *, generator=None, dtype=None, device=None):
    """randint(high, size) or randint(low, high, size), as PyTorch: integers in [low, high)."""
    if size is None and isinstance(high, (tuple, list)):  # randint(high, size)
        low, high, size = 0, low, high
    if high is None:
        low, high = 0, low
    if size is None:
        raise TypeError("randint() missing required argument 'size'")
    if isinstance(size, int):
        raise TypeError(f"randint(): size must be a tuple of ints, got int {size} (write ({size},))")
    g = _gen(generator, device)
    dev = g.device if device is None else _parse_device(device)
    dt = D.dtype(dtype) if dtype is not None else D.int64
    with dev.context():
        arr = g._integers(low, high, tuple(size)).astype(dt.np)
    return _wrap(arr)


def randn_like(t, *, dtype=None, device=None, requires_grad=False, generator=None):
    dt, dev = _like(t, dtype, device)
    return randn(t.shape, dtype=dt, device=dev, requires_grad=requires_grad, generator=generator)


def rand_like(t, *, dtype=None, device=None, requires_grad=False, generator=None):
    dt, dev = _like(t, dtype, device)
    return rand(t.shape, dtype=dt, device=dev, requires_grad=requires_grad, generator=generator)


def randperm(n, *, generator=None, dtype=None, device=None):
    g = _gen(generator, device)
    dev = g.device if device is None else _parse_device(device)
    with dev.context():
        arr = g._rng.permutation(n).astype((D.dtype(dtype) if dtype else D.int64).np)
    return _wrap(arr)
