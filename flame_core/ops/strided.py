"""as_strided: a view of any (size, stride, storage_offset) geometry over a tensor's storage (the storage of its base
where it is a view), PyTorch's low-level view; and what is built on it: as_strided_ (in place), as_strided_scatter,
empty_strided / new_empty_strided. Sizes, strides and the offset are in elements; strides are non-negative, and the
geometry must lie inside the storage (checked before the view is made). The storage is the base's C-contiguous
array (a base of another layout must be made contiguous first).

The gradient follows PyTorch's: the output's gradient is summed into a zero storage at the places the view reads (a
place read twice gets both), and the input's is read back at the input's own places. Both steps are the indexing
ops' Functions, so the gradient is differentiable again."""
import numpy as np

from .. import dtypes as D
from ..autograd.function import Function
from ..errors import ShapeError, fmt_shape
from ..tensor import _view_of
from .indexing import GetItem, ScatterInto
from .views import _ptr


def _storage_of(x, op):
    """(x's root tensor, its storage as a flat array)."""
    root = x._base if x._base is not None else x
    a = root._data
    if not a.flags.c_contiguous:
        raise ShapeError(f"{op}: the storage under this tensor (its base's, shape {fmt_shape(a.shape)}) is not "
                         f"C-contiguous; call .contiguous() first")
    return root, a.reshape(-1)


def _offset_of(x, flat):
    return (_ptr(x._data) - _ptr(flat)) // flat.itemsize


def _positions(xp, shape, strides, offset):
    """The storage index of every element of a (shape, strides, offset) view, as an int64 array of `shape`."""
    pos = xp.full(shape, offset, dtype=np.int64)
    for d, (n, st) in enumerate(zip(shape, strides)):
        pos = pos + (xp.arange(n, dtype=np.int64) * st).reshape((n,) + (1,) * (len(shape) - d - 1))
    return pos


def _geometry(op, size, stride, offset, extent):
    size = tuple(int(s) for s in size)
    stride = tuple(int(s) for s in stride)
    if len(size) != len(stride):
        raise ShapeError(f"{op}: size {size} and stride {stride} must have the same length")
    if any(s < 0 for s in size):
        raise ShapeError(f"{op}: sizes must be non-negative, got {size}")
    if any(s < 0 for s in stride):
        raise ShapeError(f"{op}: negative strides are not supported, got {stride}")
    if offset < 0:
        raise ShapeError(f"{op}: storage_offset must be non-negative, got {offset}")
    if 0 not in size:
        last = offset + sum((n - 1) * st for n, st in zip(size, stride))
        if last >= extent:
            raise ShapeError(f"{op}: size {size}, stride {stride} and storage_offset {offset} reach element {last} "
                             f"of a storage of {extent} elements")
    return size, stride


class AsStrided(Function):
    @staticmethod
    def forward(ctx, x, size, stride, offset):
        root, flat = _storage_of(x, "as_strided")
        xp = x._xp()
        isz = flat.itemsize
        out = xp.lib.stride_tricks.as_strided(flat[offset:], size, tuple(st * isz for st in stride))
        x_strides = tuple(st // isz for st in x._data.strides)
        ctx.geo = (flat.size, (size, stride, offset), (x._data.shape, x_strides, _offset_of(x, flat)))
        return _view_of(out, x)

    @staticmethod
    def backward(ctx, g):
        extent, out_geo, in_geo = ctx.geo
        xp = g._xp()
        storage = ScatterInto.apply(g, (_positions(xp, *out_geo),), (extent,))
        return GetItem.apply(storage, (_positions(xp, *in_geo),), False), None, None, None


def as_strided(input, size, stride, storage_offset=None):
    """A view of input's storage with the given size and stride (in elements), starting at storage_offset (default:
    input's own offset)."""
    _, flat = _storage_of(input, "as_strided")
    offset = _offset_of(input, flat) if storage_offset is None else int(storage_offset)
    size, stride = _geometry("as_strided", size, stride, offset, flat.size)
    return AsStrided.apply(input, size, stride, offset)


def as_strided_(self, size, stride, storage_offset=None):
    """self becomes as_strided(self, ...) in place: its metadata, not its storage, changes."""
    from .metadata_inplace import adopt
    return adopt(self, as_strided(self, size, stride, storage_offset))


def as_strided_scatter(input, src, size, stride, storage_offset=None):
    """A copy of input (laid out C-contiguous) with src written where that copy's as_strided(size, stride,
    storage_offset) view lies; differentiable in both."""
    from .indexing import IndexPut
    offset = 0 if storage_offset is None else int(storage_offset)
    size, stride = _geometry("as_strided_scatter", size, stride, offset, input.numel())
    if tuple(src.shape) != size:
        raise ShapeError(f"as_strided_scatter: src of shape {fmt_shape(src.shape)} must have the view's size "
                         f"{fmt_shape(size)}")
    pos = _positions(input._xp(), size, stride, offset)
    return IndexPut.apply(input.reshape(-1), src.to(input.dtype), (pos,)).reshape(input.shape)


def empty_strided(size, stride, *, dtype=None, device=None, requires_grad=False):
    """An uninitialised tensor with the given size and stride (a view of a fresh storage just large enough)."""
    from .creation import empty
    offset = 0
    size, stride = _geometry("empty_strided", size, stride, offset, np.iinfo(np.int64).max)
    extent = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
    buf = empty(extent, dtype=dtype or D.get_default_dtype(), device=device)
    out = as_strided(buf, size, stride, 0)
    return out.requires_grad_(True) if requires_grad else out


def new_empty_strided(self, size, stride, *, dtype=None, device=None, requires_grad=False):
    return empty_strided(size, stride, dtype=dtype or self.dtype, device=device or self.device,
                         requires_grad=requires_grad)
