"""Device and dtype conversion (`Tensor.to`), differentiable: the gradient goes back to the source device/dtype."""
import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import Tensor, _wrap


def _convert(arr, dev, np_dtype, copy):
    src_cuda = backend.is_cuda_array(arr)
    if dev is not None and (dev.type == "cuda") != src_cuda:
        if dev.type == "cuda":
            xp = backend.xp_for(dev)
            with dev.context():
                arr = xp.asarray(arr)
        else:
            arr = backend.cupy.asnumpy(arr)
        copy = False
    elif dev is not None and dev.type == "cuda" and arr.device.id != dev.index:
        with dev.context():
            arr = backend.cupy.array(arr, copy=True)
        copy = False
    if np_dtype is not None and arr.dtype != np_dtype:
        arr = arr.astype(np_dtype)
        copy = False
    if copy:
        arr = arr.copy()
    return arr


class ToCopy(Function):
    @staticmethod
    def forward(ctx, x, dev, np_dtype, copy):
        ctx.src = (x.device, x._data.dtype)
        return _wrap(_convert(x._data, dev, np_dtype, copy))

    @staticmethod
    def backward(ctx, g):
        dev, dt = ctx.src
        return to(g, dev, None if g._data.dtype == dt else _dtype_of(dt)), None, None, None


def _dtype_of(np_dtype):
    from ..dtypes import dtype_of
    return dtype_of(np_dtype)


def to(x, dev=None, dt=None, copy=False):
    np_dtype = dt.np if dt is not None else None
    same_dev = dev is None or dev == x.device
    same_dt = np_dtype is None or np_dtype == x._data.dtype
    if same_dev and same_dt and not copy:
        return x
    return ToCopy.apply(x, None if same_dev else dev, None if same_dt else np_dtype, copy)


def numpy_of(t):
    return np.asarray(backend.to_numpy(t._data))
