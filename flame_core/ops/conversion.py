"""Device and dtype conversion (`Tensor.to`), differentiable: the gradient goes back to the source device/dtype."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..autograd.function import Function
from ..tensor import _wrap

F8 = np.dtype(D.float8_e4m3fn.np)


def _fp8_kernel(name, arr, out_dtype):
    from ..kernels import launching, loader, plans
    out = backend.cupy.empty(arr.shape, dtype=out_dtype)
    if arr.size:
        src = arr if arr.flags.c_contiguous else backend.cupy.ascontiguousarray(arr)
        k = loader.get_function("fp8_cast", name, src.dtype if name == "to_fp8_e4m3" else out_dtype)
        launching.launch(k, min(plans.cdiv(arr.size, 256), 65535), 256, (src, out, np.int64(arr.size)))
    return out


def _convert(arr, f8, dev, np_dtype, copy):
    """Move/cast an array. fp8 on cuda is kept as raw e4m3 bytes in a uint8 array (`f8` True): CuPy has no fp8
    dtype. Returns (array, is_fp8_bytes)."""
    if dev is None and type(arr) is np.ndarray:   # a cast on the CPU (the common eager case): nothing to move
        if np_dtype is not None and arr.dtype != np_dtype:
            return arr.astype(np_dtype), f8
        return (arr.copy() if copy else arr), f8
    src_cuda = backend.is_cuda_array(arr)
    if dev is not None and (dev.type == "cuda") != src_cuda:
        if dev.type == "cuda":
            if arr.dtype == F8:
                arr, f8 = arr.view(np.uint8), True
            with dev.context():
                arr = backend.xp_for(dev).asarray(arr)
        else:
            arr = backend.cupy.asnumpy(arr)
            if f8:
                arr, f8 = arr.view(F8), False
        copy = False
    elif dev is not None and dev.type == "cuda" and arr.device.id != dev.index:
        with dev.context():
            arr = backend.cupy.array(arr, copy=True)
        copy = False
    if np_dtype is not None:
        if backend.is_cuda_array(arr):
            if f8 and np_dtype != F8:
                arr, f8, copy = _fp8_kernel("from_fp8_e4m3", arr, np_dtype if np_dtype.kind == "f" or
                                            np_dtype == D.bfloat16.np else np.float32), False, False
                if arr.dtype != np_dtype:
                    arr = arr.astype(np_dtype)
            elif not f8 and np_dtype == F8:
                src = arr if arr.dtype.kind == "f" or arr.dtype == D.bfloat16.np else arr.astype(np.float32)
                arr, f8, copy = _fp8_kernel("to_fp8_e4m3", src, np.uint8), True, False
            elif not f8 and arr.dtype != np_dtype:
                arr, copy = arr.astype(np_dtype), False
        elif arr.dtype != np_dtype:
            arr, copy = arr.astype(np_dtype), False
    if copy:
        arr = arr.copy()
    return arr, f8


class ToCopy(Function):
    @staticmethod
    def forward(ctx, x, dev, np_dtype, copy):
        ctx.src = (x.device, x.dtype)
        arr, f8 = _convert(x._data, x._f8, dev, np_dtype, copy)
        out = _wrap(arr)
        if f8:
            out._f8 = True
        return out

    @staticmethod
    def backward(ctx, g):
        dev, dt = ctx.src
        return to(g, dev, None if g.dtype == dt else dt), None, None, None


def to(x, dev=None, dt=None, copy=False):
    np_dtype = dt.np if dt is not None else None
    same_dev = dev is None or dev == x.device
    same_dt = dt is None or dt == x.dtype
    if same_dev and same_dt and not copy:
        return x
    return ToCopy.apply(x, None if same_dev else dev, None if same_dt else np_dtype, copy)


class CopyFrom(Function):
    """The value of `dst.copy_(src)`: src broadcast to dst's shape in dst's dtype/device; the old value gets no
    gradient, src gets the gradient summed back to its shape (on its device and dtype)."""

    @staticmethod
    def forward(ctx, dst, src):
        a, _ = _convert(src._data, src._f8, dst.device, dst.dtype.np, False)
        xp = backend.xp_of(dst._data)
        ctx.src_shape = src._data.shape
        ctx.src = (src.device, src.dtype)
        return _wrap(xp.broadcast_to(a, dst._data.shape).copy())

    @staticmethod
    def backward(ctx, g):
        from .promotion import sum_to
        dev, dt = ctx.src
        return None, to(sum_to(g, ctx.src_shape), dev, None if g.dtype == dt else dt)
