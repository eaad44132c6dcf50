"""Order statistics and NaN-aware reductions with PyTorch's semantics: median / nanmedian, quantile / nanquantile,
kthvalue, mode, cummax / cummin, aminmax, nansum / nanmean.

Values are differentiable (they are gathered from the input at the selected indices: the gradient goes back through
those indices, as sort's; quantile's interpolation weights both neighbours); indices are int64. NaN follows PyTorch:
median, quantile and cummax / cummin propagate it (a slice holding a NaN gives NaN, with a NaN's index), the nan*
variants leave NaN out (an all-NaN slice gives NaN)."""
import collections

import numpy as np

from .. import backend
from ..autograd.function import Function
from ..errors import ShapeError
from ..tensor import Tensor, _wrap
from . import elementwise as E
from . import reduction as R
from .shape import stack
from .sorting import _argsort, _axis, _keys, _take

median_result = collections.namedtuple("median", ["values", "indices"])
kthvalue_result = collections.namedtuple("kthvalue", ["values", "indices"])
cummax_result = collections.namedtuple("cummax", ["values", "indices"])
cummin_result = collections.namedtuple("cummin", ["values", "indices"])
aminmax_result = collections.namedtuple("aminmax", ["min", "max"])


def _select(x, a, axis, pos, keepdim):
    """(values, indices) of x's sorted order along axis at per-slice positions `pos` (an int array of x's shape
    without axis); `a` is x's sort keys (sorting._keys)."""
    xp = backend.xp_of(a)
    order = _argsort(a, axis, False)                                  # NaN last
    idx = xp.take_along_axis(order, xp.expand_dims(xp.asarray(pos, dtype=np.int64), axis), axis=axis)
    xv = x if x.ndim else x.reshape(1)
    vals, ind = _take(xv, axis, idx)
    if not keepdim:
        vals, ind = vals.squeeze(axis), ind.squeeze(axis)
    return vals, ind


def _nan_counts(a, axis):
    """(NaN count per slice, slice length) of the sort keys `a` along axis."""
    xp = backend.xp_of(a)
    nan = xp.isnan(a) if a.dtype.kind == "f" else xp.zeros(a.shape, dtype=bool)
    return nan.sum(axis=axis), a.shape[axis]


def _median(x, dim, keepdim, ignore_nan):
    op = "nanmedian" if ignore_nan else "median"
    if dim is None:
        flat = x.reshape(-1)
        if flat.shape[0] == 0:
            raise ShapeError(f"{op}: the input is empty (no median; pass dim= for a median along a dimension)")
        return _median(flat, 0, False, ignore_nan).values
    axis = _axis(x, dim, op)
    n = x.shape[axis] if x.ndim else 1
    if n == 0:
        raise ShapeError(f"{op}: dimension {dim} of {tuple(x.shape)} is empty")
    a = _keys(x, op)
    nans, n = _nan_counts(a, axis)
    valid = n - nans
    if ignore_nan:   # the lower median of the numbers; an all-NaN slice: its middle element (PyTorch's)
        pos = backend.xp_of(valid).where(valid > 0, (valid - 1) // 2, (n - 1) // 2)
    else:            # any NaN: the first NaN of the sorted slice (NaN sorts last)
        pos = backend.xp_of(valid).where(nans > 0, valid, (n - 1) // 2)
    vals, ind = _select(x, a, axis, pos, keepdim or x.ndim == 0)
    if x.ndim == 0:
        vals, ind = vals.reshape(()), ind.reshape(())
    return median_result(vals, ind)


def median(input, dim=None, keepdim=False):
    """The lower median (of an even count, the smaller middle value): of all elements (a 0-d tensor) or along dim
    (values, indices); a NaN in the slice gives NaN."""
    return _median(input, dim, keepdim, ignore_nan=False)


def nanmedian(input, dim=None, keepdim=False):
    return _median(input, dim, keepdim, ignore_nan=True)


def kthvalue(input, k, dim=-1, keepdim=False):
    """The k-th smallest value along dim (k from 1) and its index."""
    axis = _axis(input, dim, "kthvalue")
    n = input.shape[axis] if input.ndim else 1
    if not 1 <= k <= n:
        raise IndexError(f"kthvalue: k = {k} out of range for a dimension of size {n}")
    a = _keys(input, "kthvalue")
    pos = backend.xp_of(a).full(tuple(s for i, s in enumerate(a.shape) if i != axis), k - 1, dtype=np.int64)
    vals, ind = _select(input, a, axis, pos, keepdim or input.ndim == 0)
    if input.ndim == 0:
        vals, ind = vals.reshape(()), ind.reshape(())
    return kthvalue_result(vals, ind)


_INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")


def _quantile(x, q, dim, keepdim, interpolation, ignore_nan):
    op = "nanquantile" if ignore_nan else "quantile"
    if interpolation not in _INTERPOLATIONS:
        raise ValueError(f"{op}: interpolation must be one of {_INTERPOLATIONS}, got {interpolation!r}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: input must be a floating point tensor, got {x.dtype}")
    scalar_q = not isinstance(q, Tensor)
    qs = np.atleast_1d(np.asarray(backend.to_numpy(q._data) if isinstance(q, Tensor) else q, dtype=np.float64))
    if qs.ndim > 1 or ((qs < 0) | (qs > 1)).any():
        raise ValueError(f"{op}: q must be a scalar or a 1-D tensor of values in [0, 1], got {q}")
    if dim is None:
        src, axis = x.reshape(-1), 0
    else:
        src, axis = (x if x.ndim else x.reshape(1)), _axis(x, dim, op)
    if src.shape[axis] == 0:
        raise ShapeError(f"{op}: the input is empty along dimension {axis}")
    a = _keys(src, op)
    xp = backend.xp_of(a)
    nans, n = _nan_counts(a, axis)
    order = _argsort(a, axis, False)                                  # NaN last
    outs = []
    for qv in qs:
        # PyTorch's ranks: nanquantile over the numbers of each slice (an all-NaN slice: rank 0, a NaN), quantile
        # over all (a slice holding a NaN: the last rank, a NaN); the value (and its gradient) comes from the order
        # statistics at floor / ceil of the rank
        if ignore_nan:
            rank = xp.maximum(qv * (n - nans - 1), 0.0)
        else:
            rank = xp.where(nans > 0, float(n - 1), qv * (n - 1))
        if interpolation == "lower":
            rank = xp.floor(rank)
        elif interpolation == "higher":
            rank = xp.ceil(rank)
        elif interpolation == "nearest":   # round half to even, as PyTorch
            rank = xp.round(rank)
        lo = rank.astype(np.int64)
        hi = xp.ceil(rank).astype(np.int64)
        if interpolation == "midpoint":
            w = xp.where(hi > lo, 0.5, 0.0)
        else:
            w = rank - lo

        def at(p):
            idx = xp.take_along_axis(order, xp.expand_dims(p, axis), axis=axis)
            return _take(src, axis, idx)[0].squeeze(axis)
        vlo = at(lo)
        if interpolation in ("linear", "midpoint"):
            v = vlo + (at(hi) - vlo) * _wrap(xp.asarray(w)).to(x.dtype)
        else:
            v = vlo
        if keepdim:
            v = v.unsqueeze(axis) if dim is not None else v.reshape((1,) * x.ndim)
        outs.append(v)
    return outs[0] if scalar_q else stack(outs, dim=0)


def quantile(input, q, dim=None, keepdim=False, *, interpolation="linear"):
    """The q-th quantiles (q a float or a 1-D tensor in [0, 1]: then they lead the output's dims) of all elements
    or along dim; interpolation between the two nearest order statistics as PyTorch's ("linear", "lower", "higher",
    "midpoint", "nearest"); a NaN in the slice gives NaN."""
    return _quantile(input, q, dim, keepdim, interpolation, ignore_nan=False)


def nanquantile(input, q, dim=None, keepdim=False, *, interpolation="linear"):
    return _quantile(input, q, dim, keepdim, interpolation, ignore_nan=True)


def _cum_extreme(x, dim, is_max):
    op = "cummax" if is_max else "cummin"
    axis = _axis(x, dim, op)
    if x.ndim == 0:
        return x.clone(), _wrap(backend.xp_of(x._data).zeros((), dtype=np.int64))
    a = _keys(x, op)
    xp = backend.xp_of(a)
    am = xp.moveaxis(a, axis, 0)
    n = am.shape[0]
    idx = xp.zeros(am.shape, dtype=np.int64)
    if n:
        best = am[0].copy()
        cur = xp.zeros(am.shape[1:], dtype=np.int64)
        isnan = (lambda v: xp.isnan(v)) if a.dtype.kind == "f" else (lambda v: xp.zeros(v.shape, dtype=bool))
        for i in range(1, n):
            v = am[i]
            better = (v >= best) if is_max else (v <= best)
            take = isnan(v) | (~isnan(best) & better)   # PyTorch: a NaN is kept once seen (the latest NaN's index)
            best = xp.where(take, v, best)
            cur = xp.where(take, i, cur)
            idx[i] = cur
    idx = xp.moveaxis(idx, 0, axis)
    vals, ind = _take(x, axis, idx)
    return vals, ind


def cummax(input, dim):
    """The running maximum along dim and the index where each was reached (ties: the latest), as torch.cummax."""
    return cummax_result(*_cum_extreme(input, dim, True))


def cummin(input, dim):
    return cummin_result(*_cum_extreme(input, dim, False))


def aminmax(input, *, dim=None, keepdim=False):
    return aminmax_result(R.amin(input, dim, keepdim), R.amax(input, dim, keepdim))


class _NanZero(Function):
    """NaN -> 0, the gradient multiplied by the mask of the numbers (PyTorch's nansum backward: an infinite upstream
    gradient gives NaN at the NaN positions, as 0 * inf)."""

    @staticmethod
    def forward(ctx, x):
        a = x._data
        xp = backend.xp_of(a)
        keep = ~xp.isnan(a.astype(np.float32) if a.dtype.itemsize < 4 else a)
        ctx.keep = keep
        return _wrap(xp.where(keep, a, 0).astype(a.dtype, copy=False))

    @staticmethod
    def backward(ctx, g):
        return g * _wrap(ctx.keep).to(g.dtype)


def nansum(input, dim=None, keepdim=False, *, dtype=None):
    """sum with NaN taken as 0."""
    if not input.dtype.is_floating_point:
        return R.sum(input, dim, keepdim, dtype=dtype)
    return R.sum(_NanZero.apply(input), dim, keepdim, dtype=dtype)


def nanmean(input, dim=None, keepdim=False, *, dtype=None):
    """mean over the non-NaN elements (an all-NaN slice gives NaN)."""
    if not input.dtype.is_floating_point:
        raise TypeError(f"nanmean: expected a floating point tensor, got {input.dtype}")
    kept = E.logical_not(E.isnan(input))
    count = R.sum(kept.to(input.dtype if dtype is None else dtype), dim, keepdim)
    return nansum(input, dim, keepdim, dtype=dtype) / count


mode_result = collections.namedtuple("mode", ["values", "indices"])


def mode(input, dim=-1, keepdim=False):
    """The most frequent value along dim (of several, the smallest) and the index of its last occurrence, as
    PyTorch's CPU mode; the values are differentiable (gathered at the indices)."""
    axis = _axis(input, dim, "mode")
    x = input if input.ndim else input.reshape(1)
    n = x.shape[axis]
    if n == 0:
        raise ShapeError(f"mode: dimension {dim} of {tuple(input.shape)} is empty")
    a = _keys(x, "mode")
    xp = backend.xp_of(a)
    order = xp.moveaxis(_argsort(a, axis, False), axis, -1)              # stable: equal values keep input order
    srt = xp.take_along_axis(xp.moveaxis(a, axis, -1), order, axis=-1)
    rows = srt.reshape(-1, n)
    new_run = xp.ones(rows.shape, dtype=bool)
    new_run[:, 1:] = rows[:, 1:] != rows[:, :-1]
    run = xp.cumsum(new_run, axis=1) - 1 + xp.arange(rows.shape[0])[:, None] * n   # a global id per (row, run)
    counts = xp.bincount(run.reshape(-1), minlength=rows.size).reshape(rows.shape)
    best = xp.argmax(counts, axis=1)                         # runs go by value: the first maximum is the smallest
    last = xp.take_along_axis(xp.cumsum(counts, axis=1), best[:, None], axis=1) - 1   # the run's last sorted place
    idx = xp.take_along_axis(order.reshape(-1, n), last, axis=1).reshape(order.shape[:-1] + (1,))
    vals, ind = _take(x, axis, xp.moveaxis(idx, -1, axis))
    if not keepdim or input.ndim == 0:
        vals, ind = vals.squeeze(axis), ind.squeeze(axis)
    if input.ndim == 0:
        vals, ind = vals.reshape(()), ind.reshape(())
    return mode_result(vals, ind)
