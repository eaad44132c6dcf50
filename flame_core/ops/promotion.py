"""How the operands of an elementwise op meet: PyTorch's type promotion (with its fast path for Python scalars),
a 0-d cpu tensor joining a cuda op, float8 being storage only, and undoing broadcasting in backward (`sum_to`)."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import DeviceError, DTypeError
from ..tensor import Tensor

_default_float = D.get_default_dtype
_cupy_ndarray = backend._cupy_ndarray if backend.cupy is not None else None


def _operands(op, a, b):
    """Arrays of a and b (tensors -> arrays, scalars kept) and the PyTorch result dtype (NumPy dtype)."""
    ta, tb = isinstance(a, Tensor), isinstance(b, Tensor)
    if (ta and a._f8) or (tb and b._f8):
        _fp8_storage_only(op)
    if ta and tb:
        xa, xb = a._data, b._data
        if xa.dtype == xb.dtype:
            dt = xa.dtype
            if dt is _F8:
                _fp8_storage_only(op)
        else:
            if xa.dtype is _F8 or xb.dtype is _F8:
                _fp8_storage_only(op)
            dt = D.result_type(a, b).np
        if type(xa) is not type(xb):
            xa, xb = _align_devices(op, a, b)
            ta, tb = not _is_scalar(xa), not _is_scalar(xb)  # a 0-d cpu tensor joins as a Python scalar
    elif ta:
        xa, xb = a._data, b
        dt = xa.dtype
        if dt is _F8:
            _fp8_storage_only(op)
        if type(b) is float and dt in _FLOAT_NP:  # _keeps_dtype's commonest case, inlined
            return xa, b, dt
        if not _keeps_dtype(dt, b):
            dt = D.result_type(a, b).np
    else:
        xa, xb = a, b._data
        dt = xb.dtype
        if dt is _F8:
            _fp8_storage_only(op)
        if type(a) is float and dt in _FLOAT_NP:
            return a, xb, dt
        if not _keeps_dtype(dt, a):
            dt = D.result_type(a, b).np
    if ta and xa.dtype is not dt and xa.dtype != dt:
        xa = xa.astype(dt)
    if tb and xb.dtype is not dt and xb.dtype != dt:
        xb = xb.astype(dt)
    return xa, xb, dt


_FLOAT_NP = frozenset(np.dtype(d) for d in (np.float16, np.float32, np.float64, D.bfloat16.np, D.float8_e4m3fn.np))
_F32_64 = frozenset((np.dtype(np.float32), np.dtype(np.float64)))  # the backward fast paths' dtypes: no half-type
# rounding question (the composed rule evaluates some functions in float32), the same ufuncs, bit for bit
_F8 = np.dtype(D.float8_e4m3fn.np)  # NumPy hands out this one dtype object for every float8 array: `is` suffices
_INT_NP = frozenset(np.dtype(d) for d in (np.int8, np.int16, np.int32, np.int64, np.uint8))


def _keeps_dtype(arr_dtype, scalar):
    """Fast path of PyTorch promotion: a Python scalar of the same or a lower category keeps the tensor's dtype."""
    t = type(scalar)
    if t is float:
        return arr_dtype in _FLOAT_NP
    if t is int:
        return arr_dtype in _FLOAT_NP or arr_dtype in _INT_NP
    return False


def _align_devices(op, a, b):
    """A 0-d cpu tensor may join a cuda op (as in PyTorch); anything else on two devices is an error."""
    if a.ndim == 0 and not backend.is_cuda_array(a._data):
        return a._data.item(), b._data
    if b.ndim == 0 and not backend.is_cuda_array(b._data):
        return a._data, b._data.item()
    raise DeviceError(f"{op}: expected all tensors on the same device, but found at least two devices, "
                      f"{a.device} and {b.device}")


def _is_scalar(x):
    return isinstance(x, (bool, int, float, complex))


def _cast(arr, dt):
    ta = type(arr)
    if ta is not np.ndarray and ta is not _cupy_ndarray and not backend.is_cuda_array(arr):
        arr = np.asarray(arr)
    adt = arr.dtype
    return arr if adt is dt or adt == dt else arr.astype(dt)

def sum_to_size(x, *size):
    """Tensor.sum_to_size: x summed down to `size`, a shape x is an expansion of (differentiable)."""
    from ..errors import ShapeError
    size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else tuple(size)
    try:
        ok = tuple(np.broadcast_shapes(size, tuple(x.shape))) == tuple(x.shape)
    except ValueError:
        ok = False
    if not ok:
        raise ShapeError(f"sum_to_size: size {size} is not expandable to the tensor's {tuple(x.shape)}")
    return sum_to(x, size)


def sum_to(g, shape):
    """Undo broadcasting: sum `g` down to `shape` (differentiable)."""
    if shape is None:
        return None
    gs = g._data.shape
    if gs == shape or gs == tuple(shape):
        return g
    nd = g.ndim - len(shape)
    axes = tuple(range(nd)) + tuple(i + nd for i, s in enumerate(shape) if s == 1 and g.shape[i + nd] != 1)
    if axes:
        g = g.sum(dim=axes, keepdim=True)
    return g.reshape(shape) if tuple(g.shape) != tuple(shape) else g


def _shape(x):
    return x._data.shape if isinstance(x, Tensor) else None


def _fp8_storage_only(op):
    raise DTypeError(f"{op}: float8_e4m3fn tensors are storage only (no arithmetic, on any device); convert with "
                     f".to(dtype) first")


def no_fp8(op, x):
    """Raise the storage-only error when `x` is a float8 tensor (ml_dtypes array on cpu, flagged bytes on cuda)."""
    if x._f8 or x._data.dtype is _F8:
        _fp8_storage_only(op)


def _float_arr(x, op="elementwise op"):
    a = x._data
    dt = a.dtype
    if dt in _FLOAT_NP:
        if x._f8 or dt is _F8:
            _fp8_storage_only(op)
        return a
    if x._f8:
        _fp8_storage_only(op)
    if dt.kind != "f" and dt not in (D.bfloat16.np,):
        a = a.astype(_default_float().np)
    return a
