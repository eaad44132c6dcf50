"""Copies of a tensor with values written into some of its places, PyTorch's functional forms of assignment:
index_put / put (accumulating or not), masked_scatter, and the slice / select / diagonal scatters (the inverses of
slicing, select and diagonal). Each is differentiable in the input (zero gradient where overwritten; all of it where
accumulated) and in the values (the gradient read back at their places)."""
import numpy as np

from .. import backend
from ..autograd.function import Function
from ..errors import ShapeError, fmt_shape
from ..tensor import Tensor, _wrap, check_same_device
from .indexing import GetItem, IndexPut, _add_at, _index_arrays


class IndexAccumulate(Function):
    """out = x with v added at idx (repeated places accumulate): index_put(..., accumulate=True)."""

    @staticmethod
    def forward(ctx, x, v, idx):
        out = x._data.copy()
        xp = backend.xp_of(out)
        vv = xp.broadcast_to(v._data.astype(out.dtype, copy=False), out[idx].shape)
        _add_at(xp, out, idx, vv)
        ctx.idx, ctx.v_shape = idx, tuple(v.shape)
        return _wrap(out)

    @staticmethod
    def backward(ctx, g):
        from .promotion import sum_to
        gv = sum_to(GetItem.apply(g, ctx.idx, False), ctx.v_shape) if ctx.needs_input_grad[1] else None
        return g, gv, None


def _region_shape(op, x, idx):
    try:
        return x._data[idx].shape
    except IndexError as e:
        raise IndexError(f"{op}: {e} (tensor of shape {fmt_shape(x.shape)})") from None


def index_put(input, indices, values, accumulate=False):
    """input with values written at input[indices] (indices: a tuple of index tensors, None for a whole dim); with
    accumulate=True added there instead, repeated places summing (torch.index_put)."""
    op = "index_put"
    if not isinstance(indices, (tuple, list)):
        raise TypeError(f"{op}: indices must be a tuple of tensors, got {type(indices).__name__}")
    if not isinstance(values, Tensor):
        raise TypeError(f"{op}: values must be a Tensor, got {type(values).__name__}")
    check_same_device(op, input, values, *[i for i in indices if isinstance(i, Tensor)])
    if values.dtype != input.dtype:
        raise TypeError(f"{op}: values have dtype {values.dtype.name} but the input has {input.dtype.name}")
    idx, _ = _index_arrays(tuple(slice(None) if i is None else i for i in indices), input._xp(), op)
    region = _region_shape(op, input, idx)
    try:
        np.broadcast_shapes(tuple(values.shape), region)
    except ValueError:
        raise ShapeError(f"{op}: values of shape {fmt_shape(values.shape)} cannot be broadcast to the indexed "
                         f"region of shape {fmt_shape(region)} (tensor of shape {fmt_shape(input.shape)})") from None
    if accumulate:
        return IndexAccumulate.apply(input, values, idx)
    return IndexPut.apply(input, values, idx)


def put(input, index, source, accumulate=False):
    """input with source's elements written at the flat positions `index` (as if input were 1-D; negative positions
    count from the end), or added there with accumulate=True (torch.Tensor.put)."""
    if not isinstance(index, Tensor) or not isinstance(source, Tensor):
        raise TypeError("put: index and source must be Tensors")
    if index.numel() != source.numel():
        raise ShapeError(f"put: index has {index.numel()} elements but source has {source.numel()}")
    flat = index_put(input.reshape(-1), (index.reshape(-1),), source.reshape(-1), accumulate)
    return flat.reshape(input.shape)


def masked_scatter(input, mask, source):
    """input with source's first elements (in order) written where mask (broadcast to input) is True."""
    op = "masked_scatter"
    check_same_device(op, input, mask, source)
    if mask.dtype.name != "bool":
        raise TypeError(f"{op}: mask must be a bool tensor, got {mask.dtype.name}")
    if source.dtype != input.dtype:
        raise TypeError(f"{op}: source has dtype {source.dtype.name} but the input has {input.dtype.name}")
    try:
        shape = np.broadcast_shapes(tuple(mask.shape), tuple(input.shape))
    except ValueError:
        raise ShapeError(f"{op}: mask of shape {fmt_shape(mask.shape)} cannot be broadcast to the input's "
                         f"{fmt_shape(input.shape)}") from None
    if shape != tuple(input.shape):
        raise ShapeError(f"{op}: mask of shape {fmt_shape(mask.shape)} broadcasts the input "
                         f"{fmt_shape(input.shape)} to {fmt_shape(shape)}; it must not grow it")
    m = backend.xp_of(mask._data).broadcast_to(mask._data, shape)
    n = int(m.sum())
    if n > source.numel():
        raise ShapeError(f"{op}: the mask selects {n} elements but source has only {source.numel()}")
    return IndexPut.apply(input, source.reshape(-1)[:n], (m,))


def _scatter_at(op, input, src, idx, want):
    check_same_device(op, input, src)
    if tuple(src.shape) != tuple(want):
        raise ShapeError(f"{op}: src of shape {fmt_shape(src.shape)} must have the shape of the embedded part, "
                         f"{fmt_shape(want)} (input {fmt_shape(input.shape)})")
    if src.dtype != input.dtype:
        raise TypeError(f"{op}: src has dtype {src.dtype.name} but the input has {input.dtype.name}")
    return IndexPut.apply(input, src, idx)


def _dim(op, d, nd):
    if not -nd <= d < nd:
        raise IndexError(f"{op}: dimension {d} out of range for a tensor of {nd} dims")
    return d % nd


def slice_scatter(input, src, dim=0, start=None, end=None, step=1):
    """input with src written into input[..., start:end:step, ...] (along dim); src has that slice's shape."""
    d = _dim("slice_scatter", dim, input.ndim)
    if step < 1:
        raise ValueError(f"slice_scatter: step must be positive, got {step}")
    idx = (slice(None),) * d + (slice(start, end, step),)
    return _scatter_at("slice_scatter", input, src, idx, input._data[idx].shape)


def select_scatter(input, src, dim, index):
    """input with src written into input.select(dim, index); src has that selection's shape."""
    d = _dim("select_scatter", dim, input.ndim)
    n = input.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select_scatter: index {index} out of range for dimension {d} with size {n}")
    idx = (slice(None),) * d + (index % n,)
    return _scatter_at("select_scatter", input, src, idx, input._data[idx].shape)


def diagonal_scatter(input, src, offset=0, dim1=0, dim2=1):
    """input with src written into its diagonal (offset, dim1, dim2): src has diagonal()'s shape, the other dims
    first and the diagonal last."""
    op = "diagonal_scatter"
    nd = input.ndim
    d1, d2 = _dim(op, dim1, nd), _dim(op, dim2, nd)
    if d1 == d2:
        raise ValueError(f"{op}: dim1 and dim2 cannot be the same dimension ({dim1})")
    xp = input._xp()
    n1, n2 = input.shape[d1], input.shape[d2]
    length = max(0, min(n1 + min(offset, 0), n2 - max(offset, 0)))
    rest = [k for k in range(nd) if k not in (d1, d2)]
    want = tuple(input.shape[k] for k in rest) + (length,)
    grid = [None] * nd   # every dim an index array broadcasting to `want`: the region has exactly src's shape
    diag = xp.arange(length)
    grid[d1] = (diag - min(offset, 0)).reshape((1,) * len(rest) + (length,))
    grid[d2] = (diag + max(offset, 0)).reshape((1,) * len(rest) + (length,))
    for j, k in enumerate(rest):
        grid[k] = xp.arange(input.shape[k]).reshape(tuple(-1 if i == j else 1 for i in range(len(rest))) + (1,))
    return _scatter_at(op, input, src, tuple(grid), want)
