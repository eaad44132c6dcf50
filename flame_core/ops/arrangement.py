"""PyTorch's NumPy-style arranging helpers, composed of differentiable shape ops (their gradients come with them):
hstack / vstack / dstack / column_stack, hsplit / vsplit / dsplit, atleast_1d / 2d / 3d, tile, fliplr / flipud,
rot90, diff, take_along_dim, broadcast_tensors, meshgrid, cartesian_prod, tril_indices / triu_indices."""
import numpy as np

from .. import backend
from ..device import default_device
from ..device import device as _parse_device
from ..errors import ShapeError
from ..tensor import Tensor, _wrap
from . import elementwise as E
from . import indexing as I
from . import shape as S


def _tensors(op, tensors):
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{op}: expects a non-empty sequence of tensors")
    return tensors


def atleast_1d(*tensors):
    out = [t.reshape(1) if t.ndim == 0 else t for t in _unpack(tensors)]
    return out[0] if len(out) == 1 and not _was_sequence(tensors) else tuple(out)


def atleast_2d(*tensors):
    out = [t.reshape(1, 1) if t.ndim == 0 else t.unsqueeze(0) if t.ndim == 1 else t for t in _unpack(tensors)]
    return out[0] if len(out) == 1 and not _was_sequence(tensors) else tuple(out)


def atleast_3d(*tensors):
    def three(t):
        if t.ndim == 0:
            return t.reshape(1, 1, 1)
        if t.ndim == 1:
            return t.reshape(1, t.shape[0], 1)
        if t.ndim == 2:
            return t.unsqueeze(-1)
        return t
    out = [three(t) for t in _unpack(tensors)]
    return out[0] if len(out) == 1 and not _was_sequence(tensors) else tuple(out)


def _unpack(tensors):
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        return list(tensors[0])
    return list(tensors)


def _was_sequence(tensors):
    return len(tensors) == 1 and isinstance(tensors[0], (list, tuple))


def hstack(tensors):
    ts = atleast_1d(_tensors("hstack", tensors))
    return S.cat(ts, dim=0 if ts[0].ndim == 1 else 1)


def vstack(tensors):
    return S.cat(atleast_2d(_tensors("vstack", tensors)), dim=0)


row_stack = vstack


def dstack(tensors):
    return S.cat(atleast_3d(_tensors("dstack", tensors)), dim=2)


def column_stack(tensors):
    ts = [t.reshape(t.numel(), 1) if t.ndim <= 1 else t for t in _tensors("column_stack", tensors)]
    return S.cat(ts, dim=1)


def _nsplit(op, x, sections, dim, min_ndim):
    if x.ndim < min_ndim:
        raise ShapeError(f"{op}: needs a tensor of at least {min_ndim} dimension(s), got {x.ndim}")
    if isinstance(sections, int) and x.shape[dim] % sections:
        raise ShapeError(f"{op}: dimension {dim} of size {x.shape[dim]} is not divisible by {sections}")
    return S.tensor_split(x, sections, dim)


def hsplit(x, sections):
    return _nsplit("hsplit", x, sections, 0 if x.ndim == 1 else 1, 1)


def vsplit(x, sections):
    return _nsplit("vsplit", x, sections, 0, 2)


def dsplit(x, sections):
    return _nsplit("dsplit", x, sections, 2, 3)


def tile(x, dims):
    """x repeated `dims` times along its dims (dims shorter than x.ndim are padded with ones on the left, x's shape
    with ones when dims is longer), as torch.tile."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(dims) < x.ndim:
        dims = (1,) * (x.ndim - len(dims)) + dims
    return S.repeat(x, *dims)


def fliplr(x):
    if x.ndim < 2:
        raise ShapeError(f"fliplr: needs a tensor of at least 2 dimensions, got {x.ndim}")
    return S.flip(x, (1,))


def flipud(x):
    if x.ndim < 1:
        raise ShapeError("flipud: needs a tensor of at least 1 dimension")
    return S.flip(x, (0,))


def rot90(x, k=1, dims=(0, 1)):
    """x rotated by k * 90 degrees in the plane of `dims`, from the first axis towards the second."""
    if len(dims) != 2:
        raise ValueError(f"rot90: expected 2 dims, got {len(dims)}")
    d0, d1 = (d % x.ndim for d in dims) if x.ndim >= 2 else (None, None)
    if x.ndim < 2 or d0 == d1:
        raise ShapeError(f"rot90: needs two different dims of a tensor with at least 2 dimensions, got dims {dims} "
                         f"of a {x.ndim}-d tensor")
    k %= 4
    if k == 1:
        return S.transpose(S.flip(x, (d1,)), d0, d1)
    if k == 2:
        return S.flip(x, (d0, d1))
    if k == 3:
        return S.flip(S.transpose(x, d0, d1), (d1,))
    return x


def diff(x, n=1, dim=-1, prepend=None, append=None):
    """The n-th forward difference along dim (prepend / append joined first), as torch.diff."""
    if n < 0:
        raise ValueError(f"diff: order n must be non-negative, got {n}")
    if prepend is not None or append is not None:
        parts = [t for t in (prepend, x, append) if t is not None]
        x = S.cat([p if isinstance(p, Tensor) else x.new_tensor(p) for p in parts], dim=dim)
    for _ in range(n):
        m = x.shape[dim]
        if m == 0:
            break
        hi, lo = S.narrow(x, dim, 1, m - 1), S.narrow(x, dim, 0, m - 1)
        x = E.logical_xor(hi, lo) if x.dtype.name == "bool" else hi - lo
    return x


def take_along_dim(x, indices, dim=None):
    """x's values at `indices` along dim (flattened when dim is None); the two broadcast against each other except
    along dim, as torch.take_along_dim."""
    if dim is None:
        return I.gather(x.reshape(-1), 0, indices.reshape(-1))
    dim %= x.ndim
    shape_x, shape_i = list(x.shape), list(indices.shape)
    if len(shape_i) != len(shape_x):
        raise ShapeError(f"take_along_dim: input {tuple(x.shape)} and indices {tuple(indices.shape)} need the same "
                         f"number of dimensions")
    bx, bi = list(shape_x), list(shape_i)
    for d in range(len(bx)):
        if d != dim:
            n = S.broadcast_shapes((shape_x[d],), (shape_i[d],))[0]
            bx[d] = bi[d] = n
    return I.gather(S.expand(x, *bx), dim, S.expand(indices, *bi))


def broadcast_tensors(*tensors):
    ts = _unpack(tensors)
    shape = S.broadcast_shapes(*[tuple(t.shape) for t in ts])
    return tuple(S.expand(t, *shape) for t in ts)


def meshgrid(*tensors, indexing="ij"):
    """Coordinate grids of 1-D tensors: indexing "ij" (matrix, PyTorch's default) or "xy" (Cartesian: the first
    two outputs' dims swapped), as torch.meshgrid."""
    ts = _unpack(tensors)
    if indexing not in ("ij", "xy"):
        raise ValueError(f"meshgrid: indexing must be 'ij' or 'xy', got {indexing!r}")
    if any(t.ndim > 1 for t in ts):
        raise ShapeError(f"meshgrid: expects 0-d or 1-d tensors, got shapes {[tuple(t.shape) for t in ts]}")
    ts = [t.reshape(-1) for t in ts]
    swap = indexing == "xy" and len(ts) >= 2
    if swap:
        ts[0], ts[1] = ts[1], ts[0]
    n = [t.shape[0] for t in ts]
    out = []
    for i, t in enumerate(ts):
        view = [1] * len(ts)
        view[i] = n[i]
        out.append(S.expand(t.reshape(*view), *n))
    if swap:   # grids of shape (n1, n0, ...): the first two outputs trade places back
        out[0], out[1] = out[1], out[0]
    return tuple(out)


def cartesian_prod(*tensors):
    """Every combination of the 1-D tensors' elements, one per row (one tensor: itself)."""
    ts = _unpack(tensors)
    if len(ts) == 1:
        return ts[0]
    grids = meshgrid(*ts, indexing="ij")
    return S.stack([g.reshape(-1) for g in grids], dim=1)


def _tri_indices(op, row, col, offset, dtype, device, upper):
    from .. import dtypes as D
    dev = _parse_device(device) if device is not None else default_device()
    r, c = np.triu_indices(row, offset, col) if upper else np.tril_indices(row, offset, col)
    arr = np.stack([r, c]).astype((D.dtype(dtype) if dtype is not None else D.int64).np)
    with dev.context():
        return _wrap(backend.xp_for(dev).asarray(arr))


def tril_indices(row, col, offset=0, *, dtype=None, device=None):
    """(2, N): the row and column indices of the lower triangle of a row x col matrix (offset: the diagonal)."""
    return _tri_indices("tril_indices", row, col, offset, dtype, device, upper=False)


def triu_indices(row, col, offset=0, *, dtype=None, device=None):
    return _tri_indices("triu_indices", row, col, offset, dtype, device, upper=True)


def vander(x, N=None, increasing=False):
    """The Vandermonde matrix of the 1-D x: columns x ** (N-1), ..., x ** 0 (increasing=True: x ** 0 first), as
    running products (PyTorch's), so the gradient is exact at x = 0."""
    if not isinstance(x, Tensor) or x.ndim != 1:
        raise ShapeError(f"vander: x must be a 1-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    n = x.shape[0] if N is None else N
    if n < 0:
        raise ValueError(f"vander: N must be non-negative, got {N}")
    from .. import dtypes as D
    if n == 0:
        return x.new_empty((x.shape[0], 0), dtype=x.dtype if x.dtype.is_floating_point else D.int64)
    xt = x if x.dtype.is_floating_point else x.to(D.int64)
    cols = S.cat([xt.new_ones(tuple(xt.shape)).unsqueeze(1), xt.unsqueeze(1).expand(xt.shape[0], n - 1)], 1)
    out = cols.cumprod(1)
    return out if increasing else out.flip(1)


def combinations(input, r=2, with_replacement=False):
    """The r-length combinations of the 1-D input's elements, one per row (itertools.combinations' order; with
    replacement, combinations_with_replacement's); a (0, r) tensor when there are none."""
    import itertools
    import math
    if not isinstance(input, Tensor) or input.ndim != 1:
        raise ShapeError(f"combinations: expected a 1-D tensor, got {getattr(input, 'shape', type(input).__name__)}")
    if r < 0:
        raise ValueError(f"combinations: r must be non-negative, got {r}")
    n = input.shape[0]
    if r == 0:
        return input.new_empty((0,))
    count = math.comb(n + r - 1, r) if with_replacement else math.comb(n, r)
    if count * r > 1 << 31:
        raise ValueError(f"combinations: {count} combinations of {r} from {n} elements are too many to index")
    gen = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    idx = np.fromiter(itertools.chain.from_iterable(gen(range(n), r)), dtype=np.int64, count=count * r)
    idx = idx.reshape(count, r)
    return I.getitem(input, backend.xp_of(input._data).asarray(idx))


def unravel_index(indices, shape):
    """The coordinates in a tensor of `shape` of the flat (row-major) `indices`: a tuple of int64 tensors shaped
    like indices, one per dim."""
    if not isinstance(indices, Tensor):
        raise TypeError(f"unravel_index: indices must be a Tensor, got {type(indices).__name__}")
    if indices.dtype.is_floating_point or indices.dtype.name == "bool":
        raise TypeError(f"unravel_index: expected integer indices, got {indices.dtype.name}")
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"unravel_index: sizes must be non-negative, got {shape}")
    total = int(np.prod(shape, dtype=object)) if shape else 1
    a = indices._data
    xp = backend.xp_of(a)
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < -total or hi >= total:
            raise IndexError(f"unravel_index: index {lo if lo < -total else hi} is out of bounds for shape {shape}")
    flat = xp.where(a < 0, a + total, a).astype(np.int64)
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else flat * 0)
        flat = flat // s if s else flat
    return tuple(_wrap(o) for o in reversed(out))
