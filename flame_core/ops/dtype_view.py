"""Tensor.view(dtype): the same bytes read as another dtype (no copy, no conversion), with PyTorch's rules.

Equal element sizes keep shape and strides. Otherwise the tensor needs at least one dimension and a last dimension of
stride 1; a smaller element multiplies the last size by the ratio, a larger one divides it and needs the last size,
every other stride and the storage offset (in elements) divisible by the ratio. Not differentiable (as in PyTorch:
the result has no grad_fn); it shares the version counter, so an in-place write through it is seen by autograd."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import ShapeError
from ..tensor import Tensor


def _storage_offset(x):
    """Elements between the start of the storage (the root tensor's array) and this tensor's first element."""
    root = x._base._data if x._base is not None else x._data
    ptr = (lambda a: a.data.ptr if backend.is_cuda_array(a) else a.ctypes.data)
    return (ptr(x._data) - ptr(root)) // x._data.itemsize


def view_dtype(x, dtype):
    new, old = D.dtype(dtype), x.dtype
    if new is old:
        return x
    a = x._data
    so, sn = old.itemsize, new.itemsize
    what = f"to view {old.name} as {new.name} (different element sizes)"
    if so != sn:
        if a.ndim == 0:
            raise ShapeError(f"self.dim() cannot be 0 {what}")
        strides = x.stride()
        if strides[-1] != 1:
            raise ShapeError(f"self.stride(-1) must be 1 {what}, but got {strides[-1]}")
        if sn > so:
            ratio = sn // so
            if a.shape[-1] % ratio:
                raise ShapeError(f"self.size(-1) must be divisible by {ratio} {what}, but got {a.shape[-1]}")
            off = _storage_offset(x)
            if off % ratio:
                raise ShapeError(f"self.storage_offset() must be divisible by {ratio} {what}, but got {off}")
            for i, s in enumerate(strides[:-1]):
                if s % ratio:
                    raise ShapeError(f"self.stride({i}) must be divisible by {ratio} {what}, but got {s}")
    f8 = new is D.float8_e4m3fn and backend.is_cuda_array(a)  # CuPy holds fp8 as its raw bytes (uint8)
    t = object.__new__(Tensor)
    t._data = a.view(np.uint8 if f8 else new.np)
    t._version = x._version
    t._f8 = f8
    return t
