"""linalg.vector_norm, matrix_norm and norm with torch.linalg's ord / dim / keepdim / dtype rules."""
import math

import numpy as np

from .. import dtypes as D
from ..errors import DTypeError, ShapeError, fmt_shape
from ..ops.reduction import Norm, _dims, amax, amin
from ..tensor import Tensor
from .svd import svdvals


def _input(op, x, dtype):
    if not isinstance(x, Tensor):
        raise TypeError(f"linalg.{op}: expected a Tensor, got {type(x).__name__}")
    if dtype is not None:
        x = x.to(D.dtype(dtype))
    if not x.dtype.is_floating_point or x.dtype is D.float8_e4m3fn:
        raise DTypeError(f"linalg.{op}: expected a floating point tensor, got {x.dtype.name}")
    return x


def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """(sum |x|^ord)^(1/ord) over `dim` (None: every element); ord inf / -inf: max / min |x|; ord 0: the number of
    non-zero entries. The gradient is 0 where the norm is 0 (PyTorch's subgradient)."""
    x = _input("vector_norm", x, dtype)
    if isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise ValueError(f"linalg.vector_norm: ord must be a number, got {ord!r}")
    axes = _dims(dim, x.ndim, "linalg.vector_norm")
    if ord == math.inf:
        return amax(x.abs(), axes, keepdim)
    if ord == -math.inf:
        return amin(x.abs(), axes, keepdim)
    if ord == 0:
        count = (x.detach() != 0).to(x.dtype).sum(axes, keepdim)
        return count + (x * 0).sum(axes, keepdim) if x.requires_grad else count  # zero gradient, on the graph
    if ord == 1:
        return x.abs().sum(axes, keepdim)
    if ord > 0:
        return Norm.apply(x, float(ord), axes, keepdim)
    with np.errstate(divide="ignore"):  # a zero entry makes the sum inf and the norm 0, as in PyTorch
        return (x.abs() ** float(ord)).sum(axes, keepdim) ** (1.0 / ord)


def _two_dims(op, A, dim):
    if not (isinstance(dim, (tuple, list)) and len(dim) == 2):
        raise ValueError(f"linalg.{op}: dim must be a 2-tuple of ints, got {dim!r}")
    if A.ndim < 2:
        raise ShapeError(f"linalg.{op}: expected a tensor with at least 2 dims, got shape {fmt_shape(A.shape)}")
    d0, d1 = (int(d) for d in dim)
    for d in (d0, d1):
        if not -A.ndim <= d < A.ndim:
            raise IndexError(f"linalg.{op}: dimension {d} out of range for a tensor of {A.ndim} dims")
    d0, d1 = d0 % A.ndim, d1 % A.ndim
    if d0 == d1:
        raise ValueError(f"linalg.{op}: dims must be different, got {dim!r}")
    return d0, d1


def matrix_norm(A, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None):
    """Norm of the matrices spanned by dims `dim`: 'fro', 'nuc' (sum of singular values), 2 / -2 (largest / smallest
    singular value), 1 / -1 (max / min column abs sum), inf / -inf (max / min row abs sum)."""
    A = _input("matrix_norm", A, dtype)
    d0, d1 = _two_dims("matrix_norm", A, dim)
    if ord == "fro":
        return Norm.apply(A, 2.0, tuple(sorted((d0, d1))), keepdim)
    if ord in ("nuc", 2, -2):
        s = svdvals(A.movedim((d0, d1), (-2, -1)))
        r = s.sum(-1) if ord == "nuc" else (amax(s, -1) if ord == 2 else amin(s, -1))
        if keepdim:
            for d in sorted((d0, d1)):
                r = r.unsqueeze(d)
        return r
    if ord in (1, -1, math.inf, -math.inf):
        summed, picked = (d0, d1) if ord in (1, -1) else (d1, d0)  # 1: sum down columns; inf: along rows
        r = A.abs().sum(summed, keepdim=True)
        r = (amax if ord > 0 else amin)(r, picked, keepdim=True)
        return r if keepdim else r.squeeze((d0, d1))
    raise ValueError(f"linalg.matrix_norm: ord must be 'fro', 'nuc', 2, -2, 1, -1, inf or -inf, got {ord!r}")


def norm(A, ord=None, dim=None, keepdim=False, *, dtype=None):
    """torch.linalg.norm: a vector norm when dim is an int (or ord is None and dim is None: over every element),
    a matrix norm when dim is a 2-tuple; with dim None and ord given, A must be 1-D (vector) or 2-D (matrix)."""
    if isinstance(dim, int):
        dim = (dim,)
    if dim is not None:
        dim = tuple(dim)
        if len(dim) == 1:
            return vector_norm(A, 2 if ord is None else ord, dim, keepdim, dtype=dtype)
        if len(dim) == 2:
            return matrix_norm(A, "fro" if ord is None else ord, dim, keepdim, dtype=dtype)
        raise ValueError(f"linalg.norm: dim must be an int or a tuple of 1 or 2 ints, got {dim!r}")
    if ord is None:
        return vector_norm(A, 2, None, keepdim, dtype=dtype)
    if not isinstance(A, Tensor) or A.ndim not in (1, 2):
        raise ShapeError(f"linalg.norm: with ord={ord!r} and dim=None the input must be 1-D or 2-D, got shape "
                         f"{fmt_shape(A.shape) if isinstance(A, Tensor) else type(A).__name__}")
    if A.ndim == 1:
        if isinstance(ord, str):
            raise ValueError(f"linalg.norm: ord={ord!r} is a matrix norm but the input is 1-D")
        return vector_norm(A, ord, None, keepdim, dtype=dtype)
    return matrix_norm(A, ord, (0, 1), keepdim, dtype=dtype)
