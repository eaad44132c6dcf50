"""Scatter family with PyTorch's semantics: scatter (src or value; reduce="add"/"multiply"), scatter_reduce
("sum", "prod", "mean", "amax", "amin"; include_self), index_add, and their in-place forms (`Tensor.scatter_`,
`scatter_add_`, `scatter_reduce_`, `index_add_`: recorded by `apply_inplace`, which bumps the version counter).

Gradients follow PyTorch's (torch/csrc/autograd/FunctionsManual.cpp, scatter_reduce_backward): amax/amin share the
gradient evenly among the tied winners, prod is zero-safe. They are written with Tensor ops.
"""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..autograd.function import Function
from ..errors import DTypeError, ShapeError, fmt_shape
from ..tensor import Tensor, _wrap, check_same_device
from .indexing import ScatterInto, _add_at, _along_axis_index, gather, index_select
from .promotion import no_fp8

REDUCES = ("sum", "prod", "mean", "amax", "amin")
_UFUNC = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "maximum", "amin": "minimum"}
# CuPy's maximum.at / minimum.at are exact for 32-bit types only (float64 came back rounded to float32 on an H200):
# wider types go through the exact per-multiplicity passes
_ATOMIC_MINMAX = tuple(np.dtype(t) for t in (np.float32, np.int32, np.uint32))


# ----------------------------------------------------------------------------- arrays
def reduce_at(xp, out, idx, vals, ufunc):
    """out[idx] = ufunc(out[idx], vals) with repeated indices combined (NumPy's ufunc.at) for add / multiply /
    maximum / minimum. CuPy's `at` covers add, and maximum/minimum for 32-bit types; other cases go through
    `_reduce_at_by_rank` (exact, one pass per multiplicity)."""
    if xp is np:
        getattr(np, ufunc).at(out, idx, vals)
    elif ufunc == "add":
        _add_at(xp, out, idx, vals)
    elif ufunc in ("maximum", "minimum") and out.dtype in _ATOMIC_MINMAX:
        getattr(xp, ufunc).at(out, idx, vals)
    elif ufunc in ("maximum", "minimum") and out.dtype.kind in "fV" and out.dtype.itemsize < 4:
        acc = out.astype(np.float32)  # max/min of 16-bit floats is exact in float32
        getattr(xp, ufunc).at(acc, idx, xp.asarray(vals).astype(np.float32))
        out[...] = acc.astype(out.dtype)
    else:
        _reduce_at_by_rank(xp, out, idx, vals, ufunc)


def _reduce_at_by_rank(xp, out, idx, vals, ufunc):
    """ufunc.at without atomics: the k-th occurrence of each target is applied in pass k, so no pass has a repeated
    index and plain fancy indexing is exact. Costs one pass per multiplicity of the most repeated target."""
    shape = out.shape
    parts = xp.broadcast_arrays(*idx, xp.asarray(vals, dtype=out.dtype))
    lin = xp.zeros(parts[0].shape, dtype=np.int64)
    for i, n in zip(parts[:-1], shape):
        lin = lin * n + i.astype(np.int64)
    lin, v = lin.reshape(-1), parts[-1].reshape(-1)
    if lin.size == 0:
        return
    order = np.argsort(lin, kind="stable") if xp is np else xp.argsort(lin)
    lin, v = lin[order], v[order]
    rank = xp.arange(lin.size) - xp.searchsorted(lin, lin, side="left")
    flat = out.reshape(-1)  # out is C-contiguous (a fresh copy): a view
    f = getattr(xp, ufunc)
    for r in range(int(rank.max()) + 1):
        sel = xp.nonzero(rank == r)[0]
        t = lin[sel]
        flat[t] = f(flat[t], v[sel])


def _fill_value(dtype, reduce):
    """The identity of a reduction, to start from when the input's own values are excluded."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if dtype.kind in "fV":
        return -np.inf if reduce == "amax" else np.inf
    if dtype.kind == "b":
        return reduce == "amin"
    info = np.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


# ----------------------------------------------------------------------------- checks
def _check(op, x, dim, index, src=None, bounds=True):
    if not isinstance(x, Tensor) or not isinstance(index, Tensor):
        raise TypeError(f"{op}: input and index must be Tensors, got {type(x).__name__} and {type(index).__name__}")
    check_same_device(op, x, index, src)
    if index.dtype.is_floating_point or index.dtype is D.bool_:
        raise IndexError(f"{op}: index must be an integer tensor, got {index.dtype.name}")
    nd = max(x.ndim, 1)
    if not -nd <= dim < nd:
        raise IndexError(f"{op}: dimension {dim} out of range for a tensor of {x.ndim} dims")
    d = dim % nd
    if index.ndim != x.ndim or (isinstance(src, Tensor) and src.ndim != x.ndim):
        raise ShapeError(f"{op}: index {fmt_shape(index.shape)}" + (f", src {fmt_shape(src.shape)}"
                         if isinstance(src, Tensor) else "") + f" and input {fmt_shape(x.shape)} must have the "
                         f"same number of dims")
    for i, s in enumerate(index.shape):
        if (i != d and s > x.shape[i]) or (isinstance(src, Tensor) and s > src.shape[i]):
            raise ShapeError(f"{op}: index {fmt_shape(index.shape)} is larger than " +
                             (f"src {fmt_shape(src.shape)}" if isinstance(src, Tensor) and s > src.shape[i] else
                              f"the input {fmt_shape(x.shape)}") + f" in dimension {i} (other than dim {d})")
    if isinstance(src, Tensor) and src.dtype != x.dtype:
        raise DTypeError(f"{op}: expected src to have the input's dtype {x.dtype.name}, got {src.dtype.name}")
    no_fp8(op, x)
    if bounds and index.numel() and not index.is_cuda:  # on cuda the check would stall for the host
        ia = index._data
        lo, hi = int(ia.min()), int(ia.max())
        n = x.shape[d] if x.ndim else 1
        if lo < 0 or hi >= n:
            raise IndexError(f"{op}: index {lo if lo < 0 else hi} is out of bounds for dimension {d} with size {n}")
    return d


def _corner(a, shape):
    return a[tuple(slice(0, s) for s in shape)]


# ----------------------------------------------------------------------------- scatter / scatter_reduce
class ScatterReduce(Function):
    """out = x with src (or a scalar value) put at index along dim; `reduce` None (overwrite) or one of REDUCES."""

    @staticmethod
    def forward(ctx, x, dim, index, src, reduce, include_self):
        a = x._data
        xp = backend.xp_of(a)
        out = a.copy()
        full = _along_axis_index(xp, index._data, dim)
        vals = _corner(src._data, index.shape).astype(a.dtype, copy=False) if isinstance(src, Tensor) else \
            xp.asarray(src, dtype=a.dtype)
        hit = xp.zeros(a.shape, dtype=bool)
        hit[full] = True
        if reduce is None:
            out[full] = vals
        else:
            if not include_self:
                out[hit] = _fill_value(a.dtype, reduce)
            reduce_at(xp, out, full, vals, _UFUNC[reduce])
            if reduce == "mean":
                cnt = xp.zeros(a.shape, dtype=np.int64) + (1 if include_self else 0)
                reduce_at(xp, cnt, full, xp.ones(index.shape, dtype=np.int64), "add")
                cnt = xp.maximum(cnt, 1)
                out = (out // cnt if a.dtype.kind in "biu" else out / cnt.astype(a.dtype)).astype(a.dtype)
                ctx.count = _wrap(cnt.astype(a.dtype))
        y = _wrap(out)
        ctx.dim, ctx.reduce, ctx.include_self = dim, reduce, include_self
        ctx.src_shape = tuple(src.shape) if isinstance(src, Tensor) else None
        ctx.hit = _wrap(hit)
        ctx.save_for_backward(index, x if reduce in ("amax", "amin", "prod") else None,
                              src if reduce in ("amax", "amin", "prod") else None,
                              y if reduce in ("amax", "amin", "prod") else None)
        return y

    @staticmethod
    def backward(ctx, g):
        from .elementwise import where
        index, x, src, y = ctx.saved_tensors
        dim, reduce, hit = ctx.dim, ctx.reduce, ctx.hit
        need_x, need_src = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        gx = gs = None
        if reduce in (None, "sum", "mean"):
            if reduce == "mean":
                g = g / ctx.count  # 1 where nothing was scattered
            # the input's own values survive in every slot with include_self, else only where nothing landed
            keep = reduce is not None and ctx.include_self
            gx = (g if keep else g.masked_fill(hit, 0.0)) if need_x else None
            gs = gather(g, dim, index) if need_src else None
        elif reduce in ("amax", "amin"):
            s = _corner(src, index.shape)
            self_part = (x == y) if ctx.include_self else hit.logical_not()
            self_part = self_part.to(g.dtype)
            src_eq = (s == gather(y, dim, index)).to(g.dtype)
            count = (self_part + ScatterReduce.apply(self_part * 0, dim, index, src_eq, "sum", True)).clamp_min(1)
            gx = g * self_part / count if need_x else None
            gs = gather(g / count, dim, index) * src_eq if need_src else None
        else:  # prod, zero-safe: with one zero among a slot's factors only that factor gets a gradient
            s = _corner(src, index.shape)
            part = hit.logical_not() if not ctx.include_self else None  # does x take part in its slot?
            xz = (x == 0) if part is None else (x == 0).logical_and(part)
            sz = s == 0
            zc = ScatterReduce.apply(xz.to(g.dtype), dim, index, sz.to(g.dtype), "sum", True)
            m = ScatterReduce.apply(where(x == 0, 1.0, x), dim, index, where(sz, 1.0, s), "prod",
                                    ctx.include_self)  # product of the slot's non-zero factors

            def grad_of(gv, zv, mv, p):
                return gv * where(zv == 0, mv / where(p == 0, 1.0, p), where((zv == 1).logical_and(p == 0), mv, 0.0))
            if need_x:
                gx = grad_of(g, zc, m, x)
                if part is not None:
                    gx = where(part, gx, 0.0)
            if need_src:
                gs = grad_of(gather(g, dim, index), gather(zc, dim, index), gather(m, dim, index), s)
        if gs is not None and tuple(gs.shape) != ctx.src_shape:  # only the index-shaped corner of src was used
            gs = ScatterInto.apply(gs, tuple(slice(0, n) for n in gs.shape), ctx.src_shape)
        return gx, None, None, gs, None, None


def scatter(input, dim, index, src=None, value=None, *, reduce=None):
    """torch.scatter: out-of-place `input.scatter_(dim, index, src)`; `src` may be a Tensor or a number (or pass
    value=); reduce="add" / "multiply" combines instead of overwriting."""
    if src is None and value is None:
        raise TypeError("scatter: give src (a Tensor) or value (a number)")
    if src is not None and value is not None:
        raise TypeError("scatter: give src or value, not both")
    src = value if src is None else src
    if reduce is not None and reduce not in ("add", "multiply"):
        raise ValueError(f"scatter: reduce must be 'add' or 'multiply', got {reduce!r}")
    if not isinstance(src, Tensor) and not isinstance(src, (int, float, bool, np.number)):
        raise TypeError(f"scatter: src must be a Tensor or a number, got {type(src).__name__}")
    d = _check("scatter", input, dim, index, src if isinstance(src, Tensor) else None)
    r = None if reduce is None else {"add": "sum", "multiply": "prod"}[reduce]
    if r is not None and not isinstance(src, Tensor):  # the reduction's backward reads src as a tensor
        from .creation import full
        src = full(tuple(index.shape), src, dtype=input.dtype, device=input.device)
    return ScatterReduce.apply(input, d, index, src, r, True)


def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    """torch.scatter_reduce: reduce ("sum", "prod", "mean", "amax", "amin") src into input at index along dim;
    include_self=False leaves the input's own values out of the slots that receive something."""
    if reduce not in REDUCES:
        raise ValueError(f"scatter_reduce: reduce must be one of {REDUCES}, got {reduce!r}")
    if not isinstance(src, Tensor):
        raise TypeError(f"scatter_reduce: src must be a Tensor, got {type(src).__name__}")
    d = _check("scatter_reduce", input, dim, index, src)
    return ScatterReduce.apply(input, d, index, src, reduce, bool(include_self))



def index_reduce(input, dim, index, source, reduce, *, include_self=True):
    """torch.index_reduce: reduce ("prod", "mean", "amax", "amin") the slices of source along dim into input's
    slices at the 1-D index (a scatter_reduce whose index is the same along every other dim)."""
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise ValueError(f"index_reduce: reduce must be 'prod', 'mean', 'amax' or 'amin', got {reduce!r}")
    if not isinstance(index, Tensor) or index.ndim > 1 or index.dtype.is_floating_point:
        raise IndexError("index_reduce: index must be a 0-d or 1-d integer tensor")
    nd = max(input.ndim, 1)
    if not -nd <= dim < nd:
        raise IndexError(f"index_reduce: dimension {dim} out of range for a tensor of {input.ndim} dims")
    d = dim % nd
    want = list(input.shape) or [1]
    want[d] = index.numel()
    if list(source.shape or (1,)) != want:
        raise ShapeError(f"index_reduce: source of shape {fmt_shape(source.shape)} does not fit input "
                         f"{fmt_shape(input.shape)} with {index.numel()} indices along dim {d} (expected "
                         f"{fmt_shape(want)})")
    if not input.ndim:
        return index_reduce(input.reshape(1), 0, index, source.reshape(1), reduce,
                            include_self=include_self).reshape(())
    full = index.reshape((1,) * d + (-1,) + (1,) * (input.ndim - 1 - d)).expand(tuple(source.shape))
    return scatter_reduce(input, d, full, source, reduce, include_self=include_self)

# ----------------------------------------------------------------------------- index_add
class IndexAdd(Function):
    @staticmethod
    def forward(ctx, x, dim, index, source, alpha):
        a = x._data
        xp = backend.xp_of(a)
        out = a.copy()
        s = source._data if alpha == 1 else source._data * xp.asarray(alpha, dtype=a.dtype)
        _add_at(xp, xp.moveaxis(out, dim, 0), index._data.reshape(-1), xp.moveaxis(s, dim, 0).astype(a.dtype))
        ctx.save_for_backward(index)
        ctx.dim, ctx.alpha = dim, alpha
        return _wrap(out)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        gs = None
        if ctx.needs_input_grad[3]:
            gs = index_select(g, ctx.dim, index.reshape(-1))
            if ctx.alpha != 1:
                gs = gs * ctx.alpha
        return g, None, None, gs, None


def index_add(input, dim, index, source, *, alpha=1):
    """torch.index_add: input with alpha * source added at `index` (1-D) along dim; repeated indices accumulate."""
    op = "index_add"
    if not all(isinstance(t, Tensor) for t in (input, index, source)):
        raise TypeError(f"{op}: input, index and source must be Tensors")
    check_same_device(op, input, index, source)
    if index.dtype.is_floating_point or index.dtype is D.bool_ or index.ndim > 1:
        raise IndexError(f"{op}: index must be a 0-d or 1-d integer tensor, got {index.dtype.name} of shape "
                         f"{fmt_shape(index.shape)}")
    if source.dtype != input.dtype:
        raise DTypeError(f"{op}: source has dtype {source.dtype.name} but the input has {input.dtype.name}")
    no_fp8(op, input)
    nd = max(input.ndim, 1)
    if not -nd <= dim < nd:
        raise IndexError(f"{op}: dimension {dim} out of range for a tensor of {input.ndim} dims")
    d = dim % nd
    x, s = (input, source) if input.ndim else (input.reshape(1), source.reshape(1))
    want = list(x.shape)
    want[d] = index.numel()
    if tuple(s.shape) != tuple(want):
        raise ShapeError(f"{op}: source of shape {fmt_shape(source.shape)} does not fit input "
                         f"{fmt_shape(input.shape)} with {index.numel()} indices along dim {d} (expected "
                         f"{fmt_shape(want)})")
    if index.numel() and not index.is_cuda:
        ia = index._data
        lo, hi = int(ia.min()), int(ia.max())
        if lo < 0 or hi >= x.shape[d]:
            raise IndexError(f"{op}: index {lo if lo < 0 else hi} is out of range for dimension {d} with size "
                             f"{x.shape[d]}")
    out = IndexAdd.apply(x, d, index, s, alpha)
    return out if input.ndim else out.reshape(())


# ----------------------------------------------------------------------------- in-place Tensor methods
def install_methods(T):
    from .indexing import scatter_add
    from .inplace import apply_inplace
    from .numpy_names import with_numpy_names

    def scatter_(self, dim, index, src=None, value=None, *, reduce=None):
        if isinstance(src, Tensor):
            return apply_inplace(self, lambda t, s: scatter(t, dim, index, s, reduce=reduce), src)
        return apply_inplace(self, lambda t: scatter(t, dim, index, src, value, reduce=reduce))

    T.scatter = with_numpy_names(scatter)
    T.scatter_ = scatter_
    T.scatter_add_ = lambda self, dim, index, src: apply_inplace(
        self, lambda t, s: scatter_add(t, dim, index, s), src)
    T.scatter_reduce = with_numpy_names(scatter_reduce)
    T.scatter_reduce_ = lambda self, dim, index, src, reduce, *, include_self=True: apply_inplace(
        self, lambda t, s: scatter_reduce(t, dim, index, s, reduce, include_self=include_self), src)
    T.index_add = with_numpy_names(index_add)
    T.index_reduce = index_reduce
    T.index_reduce_ = lambda self, dim, index, source, reduce, *, include_self=True: apply_inplace(
        self, lambda t, s: index_reduce(t, dim, index, s, reduce, include_self=include_self), source)
    T.index_add_ = lambda self, dim, index, source, *, alpha=1: apply_inplace(
        self, lambda t, s: index_add(t, dim, index, s, alpha=alpha), source)
