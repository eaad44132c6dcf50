"""Sorting and selection with PyTorch's semantics: sort, argsort, topk (values differentiable: the gradient goes
back through the indices, as gather's), unique.

NaN orders above every number (PyTorch's rule): last when ascending, first when descending. Sorting is stable on
both backends (NumPy's stable kind; CuPy's argsort is always stable), so `stable=True` is honoured and ties keep
their input order whatever `descending` is.
"""
import collections

import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import ShapeError, fmt_shape
from ..tensor import Tensor, _wrap
from .promotion import no_fp8

# torch.return_types.sort / topk: named tuples (values, indices)
sort_result = collections.namedtuple("sort", ["values", "indices"])
topk_result = collections.namedtuple("topk", ["values", "indices"])


def _axis(x, dim, op):
    nd = max(x.ndim, 1)
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    if not -nd <= dim < nd:
        raise IndexError(f"{op}: dimension {dim} out of range for a tensor of {x.ndim} dims (expected in "
                         f"[{-nd}, {nd - 1}])")
    return int(dim) % nd


def _keys(x, op):
    """The array to sort: 16-bit floats are compared in float32 (exact, and CuPy's sort has no bfloat16)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: expected a Tensor, got {type(x).__name__}")
    no_fp8(op, x)
    a = x._data if x.ndim else x._data.reshape(1)
    if a.dtype == D.bfloat16.np or a.dtype == np.float16:
        a = a.astype(np.float32)
    return a


def _argsort(a, axis, descending):
    """Stable argsort along `axis`; descending keeps ties in input order (sort the reversed array ascending,
    reverse the result, and map the positions back)."""
    xp = backend.xp_of(a)
    srt = (lambda v: np.argsort(v, axis=axis, kind="stable")) if xp is np else (lambda v: xp.argsort(v, axis=axis))
    if not descending:
        return srt(a)
    n = a.shape[axis]
    rev = xp.flip(srt(xp.flip(a, axis)), axis)
    return (n - 1) - rev


def _take(x, axis, idx):
    """x gathered along `axis` at `idx` (an index array), differentiable in x."""
    from .indexing import Gather
    ind = _wrap(idx.astype(np.int64, copy=False))
    if x.ndim == 0:
        return x.clone(), ind.reshape(())
    return Gather.apply(x, axis, ind), ind


def sort(input, dim=-1, descending=False, stable=False):
    """(values, indices) sorted along `dim`; the sort is always stable (`stable` is accepted as in PyTorch)."""
    if not isinstance(stable, bool):
        raise TypeError(f"sort: stable must be a bool, got {type(stable).__name__}")
    axis = _axis(input, dim, "sort")
    v, i = _take(input, axis, _argsort(_keys(input, "sort"), axis, bool(descending)))
    return sort_result(v, i)


def argsort(input, dim=-1, descending=False, stable=False):
    """The indices that sort `input` along `dim` (int64)."""
    if not isinstance(stable, bool):
        raise TypeError(f"argsort: stable must be a bool, got {type(stable).__name__}")
    axis = _axis(input, dim, "argsort")
    idx = _argsort(_keys(input, "argsort"), axis, bool(descending)).astype(np.int64, copy=False)
    return _wrap(idx if input.ndim else idx.reshape(()))


def msort(input):
    return sort(input, 0).values


def topk(input, k, dim=-1, largest=True, sorted=True):
    """(values, indices) of the k largest (or smallest) elements along `dim`. sorted=True: in order, ties in input
    order; sorted=False: the same elements in an unspecified order (an O(n) partition on the cpu)."""
    axis = _axis(input, dim, "topk")
    n = input.shape[axis] if input.ndim else 1
    if isinstance(k, Tensor):
        k = int(k.item())
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k <= n:
        raise IndexError(f"topk: k={k!r} out of range for dimension {dim} of size {n} (shape "
                         f"{fmt_shape(input.shape)})")
    a = _keys(input, "topk")
    xp = backend.xp_of(a)
    if not sorted and xp is np and 0 < k < n:
        # the k extremes land after (largest) / before (smallest) the k-th position; NaN counts as largest
        part = np.argpartition(a, n - k if largest else k - 1, axis=axis)
        sl = [slice(None)] * a.ndim
        sl[axis] = slice(n - k, None) if largest else slice(0, k)
        idx = part[tuple(sl)]
    else:
        sl = [slice(None)] * a.ndim
        sl[axis] = slice(0, k)
        idx = _argsort(a, axis, bool(largest))[tuple(sl)]
    v, i = _take(input, axis, idx)
    return topk_result(v, i)


def unique(input, sorted=True, return_inverse=False, return_counts=False, dim=None):
    """The distinct values (dim=None: of the flattened input) or distinct slices along `dim`, as torch.unique.

    Returns the output alone, or a tuple (output, inverse_indices?, counts?) with the requested extras.
    `inverse_indices` has the input's shape (dim=None) or length input.size(dim); NaNs are never equal to each other
    (each NaN is its own value, as PyTorch). sorted=False gives the values in order of first occurrence.
    Not differentiable (neither is PyTorch's)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"unique: expected a Tensor, got {type(input).__name__}")
    no_fp8("unique", input)
    a = input._data
    xp = backend.xp_of(a)
    kw = {"equal_nan": False} if dim is None else {}
    if dim is None:
        vals, first, inv, cnt = xp.unique(a.reshape(-1), return_index=True, return_inverse=True, return_counts=True,
                                          **kw)
        inv = inv.reshape(a.shape)
    else:
        axis = _axis(input, dim, "unique")
        if a.ndim == 0:
            raise ShapeError("unique: dim was given but the input is 0-d")
        if a.shape[axis] == 0:
            vals, first = a, xp.zeros(0, dtype=np.int64)
            inv, cnt = xp.zeros(0, dtype=np.int64), xp.zeros(0, dtype=np.int64)
        else:
            vals, first, inv, cnt = xp.unique(a, return_index=True, return_inverse=True, return_counts=True,
                                              axis=axis)
            inv = inv.reshape(-1)
    if not sorted and first.size:
        order = xp.argsort(first)  # first occurrences in input order
        rank = xp.empty_like(order)
        rank[order] = xp.arange(order.size)
        vals = xp.take(vals, order, axis=0 if dim is None else axis)
        inv, cnt = rank[inv], cnt[order]
    out = [_wrap(xp.ascontiguousarray(vals))]
    if return_inverse:
        out.append(_wrap(inv.astype(np.int64, copy=False)))
    if return_counts:
        out.append(_wrap(cnt.astype(np.int64, copy=False)))
    return out[0] if len(out) == 1 else tuple(out)


def unique_consecutive(input, return_inverse=False, return_counts=False, dim=None):
    """Each run of equal consecutive values (dim=None: of the flattened input) or slices along `dim` collapsed to
    one, as torch.unique_consecutive; the extras as unique's (NaNs are never equal). Not differentiable."""
    if not isinstance(input, Tensor):
        raise TypeError(f"unique_consecutive: expected a Tensor, got {type(input).__name__}")
    no_fp8("unique_consecutive", input)
    a = input._data
    xp = backend.xp_of(a)
    if dim is None:
        rows = a.reshape(-1, 1)
    else:
        if a.ndim == 0:
            raise ShapeError("unique_consecutive: dim was given but the input is 0-d")
        axis = _axis(input, dim, "unique_consecutive")
        rows = xp.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)
    n = rows.shape[0]
    start = xp.ones(n, dtype=bool)
    if n > 1:
        start[1:] = (rows[1:] != rows[:-1]).any(axis=1) if rows.shape[1] else False
    first = xp.flatnonzero(start)
    vals = a.reshape(-1)[first] if dim is None else xp.take(a, first, axis=axis)
    out = [_wrap(xp.ascontiguousarray(vals))]
    if return_inverse:
        inv = xp.cumsum(start) - 1
        out.append(_wrap(inv.reshape(a.shape if dim is None else -1).astype(np.int64, copy=False)))
    if return_counts:
        out.append(_wrap(xp.diff(xp.append(first, n)).astype(np.int64, copy=False)))
    return out[0] if len(out) == 1 else tuple(out)
