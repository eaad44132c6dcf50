"""Reductions over `dim` (int or tuple) with `keepdim`, and softmax / log_softmax."""
import builtins
import collections

import numpy as np

from .. import backend
from .. import dtypes as D
from ..amp import autocast_mode as _amp  # autocast hook (flame_core.amp): one line per op, a flag test when off
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..errors import ShapeError, fmt_shape
from ..kernels import pointwise_small as _pws
from ..tensor import Tensor, _wrap
from .promotion import _cupy_ndarray, no_fp8

values_indices = collections.namedtuple("values_indices", ["values", "indices"])


def _dims(dim, ndim, op="reduction"):
    """Normalise dim (None, int or tuple) to a sorted tuple of non-negative axes, or None for all."""
    if dim is None:
        return None
    if type(dim) is int and -ndim <= dim < ndim:   # the common case: one axis
        return (dim % ndim,)
    if isinstance(dim, (list, tuple)):
        if len(dim) == 0:
            return None
        dims = dim
    else:
        dims = (dim,)
    out = []
    nd = builtins.max(ndim, 1)
    for d in dims:
        d = int(d)
        if not -nd <= d < nd:
            raise IndexError(f"{op}: dimension {d} out of range for a tensor of {ndim} dims")
        out.append(d % nd if ndim else 0)
    return tuple(sorted(set(out)))


def _axes(dim, ndim, op):
    """_dims for the reductions over a tuple of axes: a 0-d tensor's dim 0 / -1 (PyTorch accepts them) is all of it,
    None (its arrays have no axis 0)."""
    axes = _dims(dim, ndim, op)
    return axes if ndim else None


def _expand_back(g, shape, axes, keepdim):
    """Broadcast a reduced gradient back to the input shape."""
    if axes is None:
        axes = tuple(range(len(shape)))
    if not keepdim and len(shape):
        kept = [1 if i in axes else s for i, s in enumerate(shape)]
        g = g.reshape(kept)
    return g.expand(shape)


def _acc_dtype(a, dtype):
    if dtype is not None:
        return D.dtype(dtype).np
    if a.dtype.kind in "biu":
        return np.int64
    return a.dtype


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axes, keepdim, dtype):
        no_fp8("sum", x)
        a = x._data
        # on NumPy the ufunc's reduce itself: np.sum is a Python wrapper around it (~1.5 us a call)
        red = np.add.reduce if type(a) is np.ndarray else backend.xp_of(a).sum
        dt = _acc_dtype(a, dtype)
        if a.dtype.itemsize < 4 and a.dtype.kind != "b":  # accumulate half types in fp32
            r = red(a, axis=axes, keepdims=keepdim, dtype=np.float32).astype(dt)
        else:
            r = red(a, axis=axes, keepdims=keepdim, dtype=dt)
        ctx.shape, ctx.axes, ctx.keepdim = a.shape, axes, keepdim
        return _wrap(r)

    @staticmethod
    def backward(ctx, g):
        return _expand_back(g, ctx.shape, ctx.axes, ctx.keepdim), None, None, None


def sum(x, dim=None, keepdim=False, *, dtype=None):
    if _amp.active:  # autocast hook
        (x,) = _amp.cast_inputs("fp32", x)
    return Sum.apply(x, _axes(dim, x.ndim, "sum"), keepdim, dtype)


def mean(x, dim=None, keepdim=False, *, dtype=None):
    if not (x.dtype.is_floating_point or dtype is not None):
        raise TypeError(f"mean(): could not infer output dtype; input dtype {x.dtype} is not floating point")
    if _amp.active:  # autocast hook
        (x,) = _amp.cast_inputs("fp32", x)
    axes = _axes(dim, x.ndim, "mean")
    n = _count(x.shape, axes)
    if not n:
        return Sum.apply(x, axes, keepdim, dtype) * float("nan")
    if dtype is not None:
        x = x.to(dtype)
    return Mean.apply(x, axes, keepdim, n)


_CUDA_MEAN = frozenset(np.dtype(d) for d in (np.float32, np.float16, D.bfloat16.np))


class Mean(Function):
    """mean as one reduction (the sum and the division in one pass: xp.mean; half types summed in float32 and
    rounded once, as PyTorch). On cuda float32 / float16 / bfloat16 it is PyTorch's own arithmetic, the float32 sum
    times float32(1 / n), in two launches (CuPy's mean costs twice a sum's host time)."""

    @staticmethod
    def forward(ctx, x, axes, keepdim, n):
        no_fp8("mean", x)
        a = x._data
        ctx.shape, ctx.axes, ctx.keepdim, ctx.n = a.shape, axes, keepdim, n
        if type(a) is _cupy_ndarray and a.dtype in _CUDA_MEAN:
            r = a.sum(axis=axes, keepdims=keepdim, dtype=np.float32)
            if _pws.fast_scalar("mul", r, 1.0 / n, r) is None:
                r *= np.float32(1.0 / n)
            return _wrap(r if a.dtype == np.float32 else r.astype(a.dtype))
        if type(a) is np.ndarray:   # np.mean's own operations (the sum's reduce, then / n) without its wrappers
            r = np.add.reduce(a, axis=axes, keepdims=keepdim, dtype=np.float32 if a.dtype.itemsize < 4 else None)
            r = np.true_divide(r, n, out=r) if type(r) is np.ndarray else r.dtype.type(r / n)
            return _wrap(r if r.dtype == a.dtype else r.astype(a.dtype))
        xp = backend.xp_of(a)
        if a.dtype.itemsize < 4:
            r = xp.mean(a, axis=axes, keepdims=keepdim, dtype=np.float32).astype(a.dtype)
        else:
            r = xp.mean(a, axis=axes, keepdims=keepdim)
        return _wrap(r)

    @staticmethod
    def backward(ctx, g):
        return _expand_back(g / ctx.n, ctx.shape, ctx.axes, ctx.keepdim), None, None, None


def _count(shape, axes):
    n = 1
    for i, s in enumerate(shape):
        if axes is None or i in axes:
            n *= s
    return n


def var(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    axes = _axes(dim, x.ndim, "var")
    n = _count(x.shape, axes)
    d = x - mean(x, axes, keepdim=True)
    return sum(d * d, axes, keepdim) / builtins.max(n - correction, 0)


def std(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return var(x, dim, unbiased, keepdim, correction=correction).sqrt()


def var_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return var(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


def std_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return std(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


class Amax(Function):
    """amax/amin: the gradient is shared evenly among tied extrema (as PyTorch)."""

    @staticmethod
    def forward(ctx, x, axes, keepdim, is_max):
        no_fp8("amax" if is_max else "amin", x)
        a = x._data
        xp = backend.xp_of(a)
        if a.size == 0:
            raise ShapeError(f"{'amax' if is_max else 'amin'}: cannot reduce an empty tensor of shape "
                             f"{fmt_shape(a.shape)}")
        r = (xp.amax if is_max else xp.amin)(a, axis=axes, keepdims=keepdim)
        y = _wrap(r)
        ctx.save_for_backward(x, y)
        ctx.axes, ctx.keepdim = axes, keepdim
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        yb = _expand_back(y, x.shape, ctx.axes, ctx.keepdim)
        mask = (x == yb).to(g.dtype)
        count = mask.sum(dim=ctx.axes, keepdim=True)
        gb = _expand_back(g, x.shape, ctx.axes, ctx.keepdim)
        return gb * mask / count, None, None, None


def amax(x, dim=None, keepdim=False):
    return Amax.apply(x, _axes(dim, x.ndim, "amax"), keepdim, True)


def amin(x, dim=None, keepdim=False):
    return Amax.apply(x, _axes(dim, x.ndim, "amin"), keepdim, False)


class MaxDim(Function):
    @staticmethod
    def forward(ctx, x, dim, keepdim, is_max):
        no_fp8("max" if is_max else "min", x)
        a = x._data
        xp = backend.xp_of(a)
        idx = (xp.argmax if is_max else xp.argmin)(a, axis=dim)
        vals = xp.take_along_axis(a, xp.expand_dims(idx, dim), axis=dim)
        if not keepdim:
            vals = xp.squeeze(vals, axis=dim)
        else:
            idx = xp.expand_dims(idx, dim)
        ind = _wrap(idx.astype(np.int64))
        ctx.mark_non_differentiable(ind)
        ctx.save_for_backward(ind)
        ctx.shape, ctx.dim, ctx.keepdim = a.shape, dim, keepdim
        return _wrap(vals), ind

    @staticmethod
    def backward(ctx, g, _gi):
        (ind,) = ctx.saved_tensors
        from .indexing import one_hot_along
        onehot = one_hot_along(ind if ctx.keepdim else ind.unsqueeze(ctx.dim), ctx.shape, ctx.dim, g.dtype)
        gb = g if ctx.keepdim else g.unsqueeze(ctx.dim)
        return gb * onehot, None, None, None


def _max_min(x, dim, keepdim, is_max, other):
    if isinstance(dim, Tensor):  # max(a, b) elementwise
        from .elementwise import maximum, minimum
        return (maximum if is_max else minimum)(x, dim)
    if other is not None:
        from .elementwise import maximum, minimum
        return (maximum if is_max else minimum)(x, other)
    if dim is None:
        return Amax.apply(x, None, False, is_max)
    d = _dims(dim, x.ndim, "max")[0]
    if not x.ndim:   # dim 0 / -1 of a 0-d tensor: (x, 0), 0-d with or without keepdim (as PyTorch)
        return values_indices(*MaxDim.apply(x.reshape(1), 0, False, is_max))
    v, i = MaxDim.apply(x, d, keepdim, is_max)
    return values_indices(v, i)


def max(x, dim=None, keepdim=False, *, other=None):
    return _max_min(x, dim, keepdim, True, other)


def min(x, dim=None, keepdim=False, *, other=None):
    return _max_min(x, dim, keepdim, False, other)


def argmax(x, dim=None, keepdim=False):
    return _arg_extreme(x, dim, keepdim, "argmax")


def argmin(x, dim=None, keepdim=False):
    return _arg_extreme(x, dim, keepdim, "argmin")


def _arg_extreme(x, dim, keepdim, op):
    """argmax / argmin (`op`, also the array module's function): int64 indices, over the flattened tensor when dim
    is None."""
    no_fp8(op, x)
    a = x._data
    xp = backend.xp_of(a)
    fn = getattr(xp, op)
    if dim is None:
        r = fn(a.reshape(-1))
        return _wrap(r.astype(np.int64).reshape((1,) * a.ndim if keepdim else ()))
    d = _dims(dim, x.ndim, op)[0]
    if not a.ndim:   # a 0-d tensor's only index, 0-d with or without keepdim (CuPy refuses an axis there)
        return _wrap(xp.zeros((), dtype=np.int64))
    r = fn(a, axis=d)
    return _wrap(xp.expand_dims(r, d).astype(np.int64) if keepdim else r.astype(np.int64))


class Prod(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdim):
        no_fp8("prod", x)
        a = x._data
        xp = backend.xp_of(a)
        r = xp.prod(a, axis=axis, keepdims=keepdim, dtype=_acc_dtype(a, None))
        ctx.save_for_backward(x)
        ctx.axis, ctx.keepdim = axis, keepdim
        return _wrap(r)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        axis = ctx.axis
        if axis is None:
            flat = x.reshape(-1)
            others = _prod_of_others(flat, 0).reshape(x.shape)
            return g * others, None, None
        gb = g if ctx.keepdim else g.unsqueeze(axis)
        return gb * _prod_of_others(x, axis), None, None


def _prod_of_others(x, axis):
    """Product of all other elements along `axis`, zero-safe (exclusive cumulative products from both sides)."""
    n = x.shape[axis]
    ones_shape = list(x.shape)
    ones_shape[axis] = 1
    one = _wrap(x._xp().ones(ones_shape, dtype=x._data.dtype))
    from .shape import cat, flip, narrow
    left = cat([one, cumprod(narrow(x, axis, 0, n - 1), axis)], axis) if n > 1 else one
    rx = flip(x, [axis])
    right = flip(cat([one, cumprod(narrow(rx, axis, 0, n - 1), axis)], axis), [axis]) if n > 1 else one
    return left * right


def prod(x, dim=None, keepdim=False):
    if dim is None:
        return Prod.apply(x, None, False)
    return Prod.apply(x, _dims(dim, x.ndim, "prod")[0], keepdim)


def _cum_array(a, axis, dtype, prod):
    """cumsum / cumprod of an array in PyTorch's dtype: `dtype` when given, int64 for bool / integer input (as
    torch), else the input's; 16-bit floats accumulate in float32 and are rounded once."""
    xp, ndim = backend.xp_of(a), a.ndim
    out = np.dtype(_acc_dtype(a, dtype))
    acc = np.float32 if out.itemsize < 4 and out.kind in "fV" else out
    a = a if a.ndim else a.reshape(1)
    r = (xp.cumprod if prod else xp.cumsum)(a if a.dtype == acc else a.astype(acc), axis=axis)
    return (r if ndim else r.reshape(())).astype(out, copy=False)


class Cumsum(Function):
    @staticmethod
    def forward(ctx, x, axis, dtype):
        no_fp8("cumsum", x)
        ctx.axis = axis
        return _wrap(_cum_array(x._data, axis, dtype, False))

    @staticmethod
    def backward(ctx, g):
        return _reverse_cumsum(g, ctx.axis), None, None


def _reverse_cumsum(g, axis):
    from .shape import flip
    if g.ndim == 0:
        return g
    return flip(cumsum(flip(g, [axis]), axis), [axis])


def _cum_dtype(x, dtype, op):
    if dtype is not None:
        dtype = D.dtype(dtype)
        if x.requires_grad and not dtype.is_floating_point:
            raise TypeError(f"{op}: dtype {dtype.name} cannot carry the gradient of a tensor that requires grad")
    return dtype


def cumsum(x, dim, *, dtype=None):
    """torch.cumsum: running sums along dim; bool / integer input gives int64 unless `dtype` says otherwise."""
    dtype = _cum_dtype(x, dtype, "cumsum")
    if dtype is not None and x.dtype.is_floating_point and dtype.is_floating_point:
        x = x.to(dtype)  # the gradient goes back through the cast
        dtype = None
    return Cumsum.apply(x, _dims(dim, x.ndim, "cumsum")[0], dtype)


class Cumprod(Function):
    @staticmethod
    def forward(ctx, x, axis, dtype):
        no_fp8("cumprod", x)
        ctx.axis = axis
        y = _wrap(_cum_array(x._data, axis, dtype, True))
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        if x.ndim == 0:
            return g, None, None
        return _cumprod_grad(x, y, g, ctx.axis), None, None


def _cumprod_grad(x, y, g, axis):
    """d/dx_i of sum_j g_j y_j, y_j = prod_{k<=j} x_k, exact where x has zeros (PyTorch's rule).

    Before the first zero of a slice, dy_j/dx_i = y_j / x_i. After it every y_j is 0 whatever x_i is: 0. At the first
    zero z, dy_j/dx_z = y_{z-1} * prod_{z<k<=j} x_k for j >= z."""
    from .elementwise import where
    zero = x == 0
    seen = cumsum(zero.to(D.int32), axis)          # zeros at or before each position
    before = seen == 0                             # no zero yet
    first = zero.logical_and(seen == 1)            # the first zero of its slice
    g_before = _reverse_cumsum(g * y, axis) / where(before, x, 1.0)
    prefix = cumprod(where(before, x, 1.0), axis)  # at z: y_{z-1}
    tail = cumprod(where(seen >= 1, x, 1.0).masked_fill(first, 1.0), axis)  # for j >= z: prod_{z<k<=j} x_k
    g_first = prefix * _reverse_cumsum(g * tail * (seen >= 1).to(g.dtype), axis)
    return where(before, g_before, where(first, g_first, 0.0))


def cumprod(x, dim, *, dtype=None):
    """torch.cumprod: running products along dim (dtype rules as cumsum); the gradient is exact at zeros."""
    dtype = _cum_dtype(x, dtype, "cumprod")
    if dtype is not None and x.dtype.is_floating_point and dtype.is_floating_point:
        x = x.to(dtype)
        dtype = None
    return Cumprod.apply(x, _dims(dim, x.ndim, "cumprod")[0], dtype)


class Norm(Function):
    """The p-norm (p > 0, not 1 or inf) with PyTorch's gradient: zero where the norm is zero (the subgradient 0; the
    composed sqrt / pow would give 0·inf = NaN there). Backward is written with differentiable ops."""

    @staticmethod
    def forward(ctx, x, p, axes, keepdim):
        n = (x * x).sum(axes, keepdim).sqrt() if p == 2 else (x.abs() ** p).sum(axes, keepdim) ** (1.0 / p)
        ctx.save_for_backward(x, n)
        ctx.p, ctx.axes, ctx.keepdim = p, axes, keepdim
        return n

    @staticmethod
    def backward(ctx, g):
        x, n = ctx.saved_tensors
        p = ctx.p
        n = _expand_back(n, x.shape, ctx.axes, ctx.keepdim)
        g = _expand_back(g, x.shape, ctx.axes, ctx.keepdim)
        zero = n == 0  # then every x of that slice is 0 too
        n = n.masked_fill(zero, 1.0)
        if p == 2:
            return g * x / n, None, None, None
        ax = x.abs()
        if p < 1:  # |x|^(p-1) is infinite at x = 0: those entries get 0, as in PyTorch
            xz = x == 0
            return (x.sign() * ax.masked_fill(xz, 1.0) ** (p - 1)).masked_fill(xz, 0.0) * (g * n ** (1 - p)), \
                None, None, None
        return x.sign() * ax ** (p - 1) * (g / n ** (p - 1)), None, None, None


def norm(x, p="fro", dim=None, keepdim=False):
    axes = _axes(dim, x.ndim, "norm")
    if p in ("fro", 2, 2.0):
        return Norm.apply(x, 2, axes, keepdim)
    if p in (1, 1.0):
        return x.abs().sum(axes, keepdim)
    if p == float("inf"):
        return amax(x.abs(), axes, keepdim)
    if p == float("-inf"):
        return amin(x.abs(), axes, keepdim)
    if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
        return Norm.apply(x, float(p), axes, keepdim)
    raise ValueError(f"norm: unsupported p={p!r}")


def logsumexp(x, dim, keepdim=False):
    axes = _axes(dim, x.ndim, "logsumexp")
    m = amax(x, axes, keepdim=True).detach()
    m = m.masked_fill(m.isinf(), 0.0)
    r = (x - m).exp().sum(axes, keepdim=True).log() + m
    if not keepdim:
        r = r.squeeze(axes) if axes is not None else r.reshape(())
    return r


def all(x, dim=None, keepdim=False):
    axes = _axes(dim, x.ndim, "all")
    return _wrap(backend.xp_of(x._data).all(x._data, axis=axes, keepdims=keepdim))


def any(x, dim=None, keepdim=False):
    axes = _axes(dim, x.ndim, "any")
    return _wrap(backend.xp_of(x._data).any(x._data, axis=axes, keepdims=keepdim))


def count_nonzero(x, dim=None):
    axes = _axes(dim, x.ndim, "count_nonzero")
    xp = backend.xp_of(x._data)
    # over all axes NumPy gives a Python int, CuPy a 0-d array: xp.asarray takes both (np.asarray refuses CuPy's)
    return _wrap(xp.asarray(xp.count_nonzero(x._data, axis=axes)).astype(np.int64))


# ----------------------------------------------------------------------------- softmax family
def _softmax_arrays(a, log):
    """Reference softmax over the last axis (fp32 math for half types); the kernel family replaces it on cuda."""
    from ..kernels import softmax as K
    return K.softmax_forward(a, 1.0, log)


class Softmax(Function):
    @staticmethod
    def forward(ctx, x, dim, log):
        no_fp8("log_softmax" if log else "softmax", x)
        a = x._data
        if a.dtype.kind in "biu":
            a = a.astype(D.get_default_dtype().np)
        xp = backend.xp_of(a)
        last = dim == a.ndim - 1 or a.ndim == 0
        moved = a if last else xp.moveaxis(a, dim, -1)
        y = _softmax_arrays(moved if a.ndim else a.reshape(1), log)
        if a.ndim == 0:
            y = y.reshape(())
        elif not last:
            y = xp.moveaxis(y, -1, dim)
        out = _wrap(y)
        ctx.save_for_backward(out)
        ctx.dim, ctx.log = dim, log
        return out

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        d = ctx.dim
        if state.enabled:  # building a graph of the gradient: composed, differentiable rule
            if ctx.log:
                return g - y.exp() * g.sum(d, keepdim=True), None, None
            return y * (g - (g * y).sum(d, keepdim=True)), None, None
        from ..kernels import softmax as K
        ga, ya = g._data, y._data
        xp = backend.xp_of(ya)
        last = d == ya.ndim - 1 or ya.ndim == 0
        if not last:
            ga, ya = xp.moveaxis(ga, d, -1), xp.moveaxis(ya, d, -1)
        dx = K.softmax_backward(ga if ya.ndim else ga.reshape(1), ya if ya.ndim else ya.reshape(1), 1.0, ctx.log)
        if y.ndim == 0:
            dx = dx.reshape(())
        elif not last:
            dx = xp.moveaxis(dx, -1, d)
        return _wrap(dx), None, None


def softmax(x, dim=-1, dtype=None):
    if _amp.active:  # autocast hook
        (x,) = _amp.cast_inputs("fp32", x)
    if dtype is not None:
        x = x.to(D.dtype(dtype))
    return Softmax.apply(x, _dims(dim, x.ndim, "softmax")[0] if x.ndim else 0, False)


def log_softmax(x, dim=-1, dtype=None):
    if _amp.active:  # autocast hook
        (x,) = _amp.cast_inputs("fp32", x)
    if dtype is not None:
        x = x.to(D.dtype(dtype))
    return Softmax.apply(x, _dims(dim, x.ndim, "log_softmax")[0] if x.ndim else 0, True)
