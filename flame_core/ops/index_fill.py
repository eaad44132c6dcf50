"""index_fill / index_copy: positions along one dimension, named by a 1-D integer index, set to a value or to a
source's slices (PyTorch's; differentiable: a filled position passes no gradient to the input, a copied one passes
the source's)."""
import numpy as np

from ..errors import ShapeError, fmt_shape
from ..tensor import Tensor, _wrap, check_same_device
from .shape import _norm_dim


def _mask(op, input, dim, index):
    """(dim, a bool tensor True at index along dim, shaped to broadcast against input)."""
    if not isinstance(index, Tensor) or index.ndim > 1 or index.dtype.is_floating_point:
        raise TypeError(f"{op}: index must be a 0-d or 1-D integer Tensor")
    check_same_device(op, input, index)
    d = _norm_dim(dim, input.ndim, op)
    n = input.shape[d] if input.ndim else 1
    idx = index._data.reshape(-1)
    xp = input._xp()
    if idx.size and (int(idx.max()) >= n or int(idx.min()) < -n):
        raise IndexError(f"{op}: an index is out of range for dimension {d} of size {n}")
    m = xp.zeros(n, dtype=np.bool_)
    m[idx] = True
    shape = [1] * input.ndim
    if input.ndim:
        shape[d] = n
    return d, _wrap(m.reshape(shape))


def index_fill(input, dim, index, value):
    """input with the positions `index` along dim set to value (a number or a 0-d Tensor)."""
    from .elementwise import where
    _, m = _mask("index_fill", input, dim, index)
    if isinstance(value, Tensor) and value.ndim:
        raise ShapeError(f"index_fill: value must be a number or a 0-d Tensor, got shape {fmt_shape(value.shape)}")
    out = where(m, value, input)
    return out if out.dtype == input.dtype else out.to(input.dtype)


def index_copy(input, dim, index, source):
    """input with its slices at `index` along dim replaced by source's (source: input's shape with index's length
    along dim; repeated indices leave which copy lands undefined, as PyTorch's)."""
    from .scatter import index_add
    d, m = _mask("index_copy", input, dim, index)
    want = list(input.shape)
    if input.ndim:
        want[d] = index.numel()
    if tuple(source.shape) != tuple(want):
        raise ShapeError(f"index_copy: source of shape {fmt_shape(source.shape)} does not fit input "
                         f"{fmt_shape(input.shape)} with {index.numel()} indices along dim {d} (expected "
                         f"{fmt_shape(want)})")
    cleared = index_fill(input, d, index, 0)
    return index_add(cleared, d, index.reshape(-1), source.to(input.dtype))
