"""Indexing: __getitem__/__setitem__ (ints, slices with steps, None, Ellipsis, bool masks, index tensors),
gather, scatter_add, index_select, masked_fill, masked_select, nonzero, pad (the rest of the scatter family is in
scatter.py)."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..autograd.function import Function
from ..errors import DeviceError, DTypeError, ShapeError, fmt_shape
from ..tensor import Tensor, _view_of, _wrap, check_same_device


def _index_arrays(idx, xp, op="index"):
    """Turn a PyTorch-style index into one NumPy/CuPy understands; returns (index, is_basic)."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    out, basic = [], True
    for i in idx:
        if isinstance(i, Tensor):
            a = i._data
            if (xp is np) != (not backend.is_cuda_array(a)):
                if a.ndim == 0:
                    a = backend.to_numpy(a)
                    a = xp.asarray(a)
                else:
                    raise DeviceError(f"{op}: indices on {i.device} for a tensor on the other device")
            if a.dtype.kind == "f":
                raise IndexError(f"{op}: tensors used as indices must be long, int or bool, got {i.dtype}")
            out.append(a)
            basic = False
        elif isinstance(i, (list, np.ndarray)):
            out.append(xp.asarray(i))
            basic = False
        elif backend.is_cuda_array(i):
            out.append(i)
            basic = False
        else:
            out.append(i)
    return tuple(out), basic


class GetItem(Function):
    @staticmethod
    def forward(ctx, x, idx, basic):
        r = x._data[idx]
        ctx.idx, ctx.shape = idx, x._data.shape
        if basic:
            if not (type(r) is np.ndarray or backend.is_cuda_array(r)):
                r = x._data[idx + (Ellipsis,)]  # NumPy gives a scalar for a full integer index; this is a 0-d view
            return _view_of(r, x)
        out = _wrap(r)
        out._f8 = x._f8
        return out

    @staticmethod
    def backward(ctx, g):
        return ScatterInto.apply(g, ctx.idx, ctx.shape), None, None


class ScatterInto(Function):
    """zeros(shape) with g added at idx (duplicates accumulate); the backward of indexing."""

    @staticmethod
    def forward(ctx, g, idx, shape):
        a = g._data
        xp = backend.xp_of(a)
        out = xp.zeros(shape, dtype=a.dtype)
        _, basic = _classify(idx)
        if basic:
            out[idx] = a
        else:
            _add_at(xp, out, idx, a)
        ctx.idx = idx
        return _wrap(out)

    @staticmethod
    def backward(ctx, gg):
        _, basic = _classify(ctx.idx)
        return GetItem.apply(gg, ctx.idx, basic), None, None


def _classify(idx):
    t = idx if isinstance(idx, tuple) else (idx,)
    basic = all(not (isinstance(i, np.ndarray) or backend.is_cuda_array(i)) for i in t)
    return t, basic


def _add_at(xp, out, idx, vals):
    if xp is np:
        np.add.at(out, idx, vals)
    elif out.dtype.itemsize < 4:  # no 16-bit atomic adds in CuPy: accumulate in fp32
        acc = out.astype(np.float32)
        xp.add.at(acc, idx, vals.astype(np.float32))
        out[...] = acc.astype(out.dtype)
    else:
        xp.add.at(out, idx, vals)


def getitem(x, idx):
    xp = x._xp()
    idx, basic = _index_arrays(idx, xp, "__getitem__")
    return GetItem.apply(x, idx, basic)


class IndexPut(Function):
    """out = x with out[idx] = v (out of place; __setitem__ writes the result into x's storage)."""

    @staticmethod
    def forward(ctx, x, v, idx):
        out = x._data.copy()
        vv = v._data if isinstance(v, Tensor) else v
        if isinstance(vv, np.ndarray) or backend.is_cuda_array(vv):
            vv = vv.astype(out.dtype, copy=False)
        out[idx] = vv
        ctx.idx = idx
        ctx.v_shape = tuple(v.shape) if isinstance(v, Tensor) else None
        return _wrap(out)

    @staticmethod
    def backward(ctx, g):
        from .promotion import sum_to
        _, basic = _classify(ctx.idx)
        gx = None
        if ctx.needs_input_grad[0]:
            ga = g._data.copy()
            ga[ctx.idx] = 0
            gx = _wrap(ga)
        gv = None
        if ctx.needs_input_grad[1]:
            gv = sum_to(GetItem.apply(g, ctx.idx, basic), ctx.v_shape)
        return gx, gv, None


def setitem(x, idx, value):
    from .inplace import apply_inplace
    xp = x._xp()
    idx, _ = _index_arrays(idx, xp, "__setitem__")
    if isinstance(value, Tensor) and type(value._data) is not type(x._data):
        if value.ndim == 0:
            value = value.item()
        else:
            raise DeviceError(f"__setitem__: value on {value.device} for a tensor on {x.device}")
    from ..autograd.grad_mode import state
    try:
        if not (state.enabled and (x.requires_grad or (isinstance(value, Tensor) and value.requires_grad))):
            if state.enabled and x._base is not None:
                from .inplace import _validate_inplace
                _validate_inplace(x)
            vv = value._data if isinstance(value, Tensor) else value
            if isinstance(vv, np.ndarray) or backend.is_cuda_array(vv):
                vv = vv.astype(x._data.dtype, copy=False)
            x._data[idx] = vv
            x._version[0] += 1
            return
        apply_inplace(x, lambda t, v: IndexPut.apply(t, v, idx), value)
    except ValueError as e:
        if "broadcast" not in str(e):
            raise
        try:
            region = fmt_shape(x._data[idx].shape)
        except Exception:
            region = "?"
        vshape = fmt_shape(value.shape) if isinstance(value, Tensor) else fmt_shape(np.shape(value))
        raise ShapeError(f"__setitem__: a value of shape {vshape} cannot be broadcast to the indexed region of shape "
                         f"{region} (tensor of shape {fmt_shape(x.shape)})") from e


class Gather(Function):
    @staticmethod
    def forward(ctx, x, dim, index):
        xp = x._xp()
        ctx.save_for_backward(index)
        ctx.dim, ctx.shape = dim, x._data.shape
        a = x._data
        if any(i != dim and n < s for i, (n, s) in enumerate(zip(index.shape, a.shape))):
            a = a[tuple(slice(None) if i == dim else slice(0, n) for i, n in enumerate(index.shape))]
        return _wrap(xp.take_along_axis(a, index._data, axis=dim))

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        z = _wrap(g._xp().zeros(ctx.shape, dtype=g._data.dtype))
        return ScatterAdd.apply(z, ctx.dim, index, g), None, None


def _check_index(op, x, dim, index, src=None):
    """dim normalised; index integer, of the input's rank and no larger than it (or src) outside dim, in bounds
    (checked on the cpu only: on cuda it would stall for the host, and PyTorch's kernels assert there)."""
    from .scatter import _check
    return _check(op, x, dim, index, src)


def gather(x, dim, index, *, sparse_grad=False):
    """torch.gather: out[i][j] = x[index[i][j]][j] (dim=0); index may be smaller than x outside dim."""
    if sparse_grad:
        raise ValueError("gather: sparse_grad=True needs sparse tensors, which FLAME does not have")
    d = _check_index("gather", x, dim, index)
    if x.ndim == 0:
        return Gather.apply(x.reshape(1), 0, index.reshape(1)).reshape(())
    return Gather.apply(x, d, index)


def _along_axis_index(xp, index, dim):
    """Full index tuple for put-along-axis with duplicates (for add.at)."""
    nd = index.ndim
    grids = [xp.arange(n).reshape((1,) * i + (n,) + (1,) * (nd - i - 1)) for i, n in enumerate(index.shape)]
    return tuple(index if i == dim else grids[i] for i in range(nd))


class ScatterAdd(Function):
    @staticmethod
    def forward(ctx, x, dim, index, src):
        xp = x._xp()
        out = x._data.copy()
        ia = index._data
        sa = src._data[tuple(slice(0, s) for s in ia.shape)].astype(out.dtype, copy=False)
        _add_at(xp, out, _along_axis_index(xp, ia, dim), sa)
        ctx.save_for_backward(index)
        ctx.dim, ctx.src_shape = dim, src._data.shape
        return _wrap(out)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        gs = None
        if ctx.needs_input_grad[3]:
            gs = gather(g, ctx.dim, index)
            if tuple(gs.shape) != ctx.src_shape:  # only the index-shaped corner of src was used
                gs = ScatterInto.apply(gs, tuple(slice(0, s) for s in gs.shape), ctx.src_shape)
        return g if ctx.needs_input_grad[0] else None, None, None, gs


def scatter_add(x, dim, index, src):
    """torch.scatter_add: x with src added at index along dim (repeated indices accumulate)."""
    d = _check_index("scatter_add", x, dim, index, src)
    return ScatterAdd.apply(x, d, index, src)


def index_select(x, dim, index):
    """torch.index_select: the entries of x at `index` (0-d or 1-d, integer) along dim."""
    if not isinstance(index, Tensor) or index.dtype.is_floating_point or index.dtype.name == "bool":
        raise IndexError(f"index_select: index must be an integer tensor, got "
                         f"{index.dtype if isinstance(index, Tensor) else type(index).__name__}")
    if index.ndim > 1:
        raise ShapeError(f"index_select: index must be 0-d or 1-d, got shape {fmt_shape(index.shape)}")
    nd = max(x.ndim, 1)
    if not -nd <= dim < nd:
        raise IndexError(f"index_select: dimension {dim} out of range for a tensor of {x.ndim} dims")
    d = dim % nd
    idx = (slice(None),) * d + (index.reshape(-1),)
    return getitem(x, idx)


_NP_SCALAR_DTYPES = frozenset(np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                                                     np.int64, np.uint8, np.bool_))


class MaskedFill(Function):
    @staticmethod
    def forward(ctx, x, mask, value):
        xp = x._xp()
        m = mask._data
        if m.dtype != np.bool_:
            raise TypeError(f"masked_fill: mask must be a bool tensor, got {mask.dtype}")
        a = x._data
        ctx.save_for_backward(mask)
        if isinstance(value, Tensor):
            v = xp.asarray(value._data, dtype=a.dtype)
        elif a.dtype in _NP_SCALAR_DTYPES:   # a NumPy scalar of x's dtype: no device array made for it (host cost)
            if a.dtype == np.float16:
                with np.errstate(over="ignore"):   # (a value beyond float16's range: inf, as the array path gave)
                    v = a.dtype.type(value)
            else:
                v = a.dtype.type(value)
        else:   # (bfloat16: CuPy takes no ml_dtypes scalar)
            v = xp.asarray(value, dtype=a.dtype)
        return _wrap(xp.where(m, v, a))

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        from .elementwise import where, zeros_grad
        return where(mask, zeros_grad(g), g), None, None


def masked_fill(x, mask, value):
    try:
        ok = tuple(np.broadcast_shapes(tuple(x.shape), tuple(mask.shape))) == tuple(x.shape)
    except ValueError:
        ok = False
    if not ok:
        raise ShapeError(f"masked_fill: mask of shape {fmt_shape(mask.shape)} does not broadcast to the input's "
                         f"shape {fmt_shape(x.shape)}")
    return MaskedFill.apply(x, mask, value)


def masked_select(x, mask):
    """torch.masked_select: a 1-D tensor of the entries of x where the bool mask is True; x and mask broadcast.
    Differentiable in x (the gradient is scattered back, summed over broadcast dims)."""
    if not isinstance(mask, Tensor) or mask.dtype.name != "bool":
        raise TypeError(f"masked_select: mask must be a bool tensor, got "
                        f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
    check_same_device("masked_select", x, mask)
    try:
        shape = tuple(np.broadcast_shapes(tuple(x.shape), tuple(mask.shape)))
    except ValueError:
        raise ShapeError(f"masked_select: input {fmt_shape(x.shape)} and mask {fmt_shape(mask.shape)} do not "
                         f"broadcast") from None
    if tuple(x.shape) != shape:
        x = x.expand(shape)
    m = mask._data if tuple(mask.shape) == shape else backend.xp_of(mask._data).broadcast_to(mask._data, shape)
    return getitem(x if x.ndim else x.reshape(1), m if m.ndim else m.reshape(1))


def take(input, index):
    """torch.take: the elements of the flattened input at the (integer tensor) index, in index's shape; negative
    indices count from the end. Differentiable in input."""
    n = input._data.size
    idx = index._data if isinstance(index, Tensor) else np.asarray(index)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"take: index must be an integer tensor, got {idx.dtype}")
    if idx.size and (int(idx.max()) >= n or int(idx.min()) < -n):
        raise IndexError(f"take: an index is out of range for a tensor of {n} elements")
    flat = input.reshape(-1)
    return flat[index if isinstance(index, Tensor) else idx]


def nonzero(x, *, as_tuple=False):
    xp = x._xp()
    a = x._data
    nz = xp.nonzero(a if a.ndim else a.reshape(1))   # a 0-d tensor: one (or no) position of zero coordinates
    if not a.ndim:
        return tuple(_wrap(v.astype(np.int64)) for v in nz) if as_tuple else _wrap(
            xp.zeros((len(nz[0]), 0), dtype=np.int64))
    if as_tuple:
        return tuple(_wrap(a.astype(np.int64)) for a in nz)
    return _wrap(xp.stack(nz, axis=1).astype(np.int64) if nz else xp.zeros((0, 0), dtype=np.int64))


def one_hot_along(ind, shape, dim, dtype):
    """A 0/1 tensor of `shape` with ones where arange(shape[dim]) == ind (ind has size 1 along dim)."""
    xp = ind._xp()
    ar_shape = [1] * len(shape)
    ar_shape[dim] = shape[dim]
    ar = xp.arange(shape[dim]).reshape(ar_shape)
    return _wrap((ar == ind._data).astype(dtype.np))


def one_hot(x, num_classes=-1):
    """int64 (..., num_classes) with a 1 at each class index of x (PyTorch's rules: x holds int64 class indices;
    num_classes=-1 is max + 1; an index outside [0, num_classes) is an error)."""
    if x.dtype is not D.int64:
        raise DTypeError(f"one_hot is only applicable to index tensors (int64), got {x.dtype}")
    xp = x._xp()
    a = x._data
    if a.size == 0:
        if num_classes < 0:
            raise RuntimeError("one_hot: cannot infer the number of classes from an empty tensor (pass num_classes)")
        lo = hi = 0
    else:  # a host read, as PyTorch's (its cuda one_hot synchronises too)
        lo, hi = int(a.min()), int(a.max())
    n = hi + 1 if num_classes < 0 else int(num_classes)
    if lo < 0:
        raise RuntimeError(f"one_hot: class values must be non-negative, got {lo}")
    if hi >= n:
        raise RuntimeError(f"one_hot: class value {hi} is out of range for num_classes {n}")
    return _wrap((a[..., None] == xp.arange(n)).astype(np.int64))


class Pad(Function):
    @staticmethod
    def forward(ctx, x, widths, mode, value):
        xp = x._xp()
        a = x._data
        if mode == "constant":
            out = xp.pad(a, widths, mode="constant", constant_values=value)
        elif mode == "reflect":
            out = xp.pad(a, widths, mode="reflect")
        elif mode == "replicate":
            out = xp.pad(a, widths, mode="edge")
        elif mode == "circular":
            out = xp.pad(a, widths, mode="wrap")
        else:
            raise ValueError(f"pad: mode must be constant, reflect, replicate or circular, got {mode!r}")
        ctx.widths, ctx.mode, ctx.shape = widths, mode, a.shape
        return _wrap(out)

    @staticmethod
    def backward(ctx, g):
        if ctx.mode == "constant":
            idx = tuple(slice(lo, lo + s) for (lo, _), s in zip(ctx.widths, ctx.shape))
            return g[idx], None, None, None
        # reflect/replicate/circular: every output element came from one input element; add them back.
        xp = g._xp()
        src = xp.arange(int(np.prod(ctx.shape))).reshape(ctx.shape)
        m = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}[ctx.mode]
        src_idx = xp.pad(src, ctx.widths, mode=m).reshape(-1)
        from .shape import reshape
        flat = reshape(g, (-1,))
        z = _wrap(xp.zeros(int(np.prod(ctx.shape)), dtype=g._data.dtype))
        return reshape(scatter_add(z, 0, _wrap(src_idx), flat), ctx.shape), None, None, None


def pad(x, pad, mode="constant", value=0.0):
    """PyTorch's F.pad: `pad` lists (left, right) pairs starting from the LAST dimension."""
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ShapeError(f"pad: padding length {len(pad)} must be even and at most 2*ndim ({2 * x.ndim})")
    widths = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        widths[x.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    if any(lo < 0 or hi < 0 for lo, hi in widths):
        idx = tuple(slice(-lo if lo < 0 else None, hi if hi < 0 else None) for lo, hi in widths)
        x = x[idx]
        widths = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    if mode == "reflect":
        for (lo, hi), s in zip(widths, x.shape):
            if lo >= s or hi >= s:
                raise ShapeError(f"pad: reflect padding ({lo}, {hi}) must be smaller than the dimension {s}")
    return Pad.apply(x, tuple(widths), mode, value)
