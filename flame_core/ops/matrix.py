"""Matrix helpers with PyTorch's names: addmm / baddbmm / addbmm / addmv / addr (beta * input + alpha * product),
diag, diagonal, diag_embed, trace. All differentiable (composed of Tensor ops or a Function whose backward is the
other's forward). `diagonal` returns a copy, not a view of the input as in PyTorch (writing into it leaves the
input unchanged)."""
import numpy as np

from .. import backend
from ..autograd.function import Function
from ..errors import DTypeError, ShapeError, fmt_shape
from ..tensor import Tensor, _wrap, check_same_device
from .promotion import no_fp8


# ----------------------------------------------------------------------------- addmm / baddbmm
def _add_scaled(op, input, prod, beta, alpha):
    if not isinstance(input, Tensor):
        raise TypeError(f"{op}: input must be a Tensor, got {type(input).__name__}")
    if input.dtype != prod.dtype:
        raise DTypeError(f"{op}: input has dtype {input.dtype.name} but the product has {prod.dtype.name}")
    try:
        shape = tuple(np.broadcast_shapes(tuple(input.shape), tuple(prod.shape)))
    except ValueError:
        shape = None
    if shape != tuple(prod.shape):
        raise ShapeError(f"{op}: input of shape {fmt_shape(input.shape)} does not broadcast to the product's shape "
                         f"{fmt_shape(prod.shape)}")
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:  # PyTorch: the input is ignored, so NaN / inf in it do not propagate
        return prod
    return prod + (input if beta == 1 else input * beta)


def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """beta * input + alpha * (mat1 @ mat2); mat1 (n, m), mat2 (m, p), input broadcastable to (n, p)."""
    from .linalg import mm
    check_same_device("addmm", input, mat1, mat2)
    return _add_scaled("addmm", input, mm(mat1, mat2), beta, alpha)


def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    """beta * input + alpha * (batch1 @ batch2); batch1 (b, n, m), batch2 (b, m, p), input broadcastable to
    (b, n, p)."""
    from .linalg import bmm
    check_same_device("baddbmm", input, batch1, batch2)
    return _add_scaled("baddbmm", input, bmm(batch1, batch2), beta, alpha)



def addbmm(input, batch1, batch2, *, beta=1, alpha=1):
    """beta * input + alpha * sum over b of batch1[b] @ batch2[b]; input broadcastable to (n, p)."""
    from .linalg import bmm
    check_same_device("addbmm", input, batch1, batch2)
    return _add_scaled("addbmm", input, bmm(batch1, batch2).sum(0), beta, alpha)


def addmv(input, mat, vec, *, beta=1, alpha=1):
    """beta * input + alpha * (mat @ vec); mat (n, m), vec (m,), input broadcastable to (n,)."""
    from .linalg import mv
    check_same_device("addmv", input, mat, vec)
    return _add_scaled("addmv", input, mv(mat, vec), beta, alpha)


def addr(input, vec1, vec2, *, beta=1, alpha=1):
    """beta * input + alpha * outer(vec1, vec2); input broadcastable to (len(vec1), len(vec2))."""
    from .linalg import outer
    check_same_device("addr", input, vec1, vec2)
    return _add_scaled("addr", input, outer(vec1, vec2), beta, alpha)

# ----------------------------------------------------------------------------- diagonals
def _diag_index(xp, n, m, offset):
    """(rows, cols) of the offset diagonal of an (n, m) matrix."""
    length = max(0, min(n + min(offset, 0), m - max(offset, 0)))
    i = xp.arange(length)
    return i - min(offset, 0), i + max(offset, 0)


class Diagonal(Function):
    """The offset diagonal of the last two dims (the caller moves dim1, dim2 there): (..., n, m) -> (..., L)."""

    @staticmethod
    def forward(ctx, x, offset):
        a = x._data
        xp = backend.xp_of(a)
        r, c = _diag_index(xp, a.shape[-2], a.shape[-1], offset)
        ctx.offset, ctx.nm = offset, a.shape[-2:]
        return _wrap(xp.ascontiguousarray(a[..., r, c]))

    @staticmethod
    def backward(ctx, g):
        return DiagEmbed.apply(g, ctx.offset, ctx.nm), None


class DiagEmbed(Function):
    """(..., L) -> (..., n, m) zeros with the input on the offset diagonal of the last two dims."""

    @staticmethod
    def forward(ctx, v, offset, nm):
        a = v._data
        xp = backend.xp_of(a)
        out = xp.zeros(a.shape[:-1] + tuple(nm), dtype=a.dtype)
        r, c = _diag_index(xp, nm[0], nm[1], offset)
        out[..., r, c] = a
        ctx.offset = offset
        return _wrap(out)

    @staticmethod
    def backward(ctx, g):
        return Diagonal.apply(g, ctx.offset), None, None


def _dim(d, nd, op):
    if not -nd <= d < nd:
        raise IndexError(f"{op}: dimension {d} out of range for {nd} dims")
    return d % nd


def diagonal(input, offset=0, dim1=0, dim2=1):
    """torch.diagonal: the offset diagonal of the (dim1, dim2) planes, appended as the last dim (a copy)."""
    no_fp8("diagonal", input)
    if input.ndim < 2:
        raise ShapeError(f"diagonal: expected at least 2 dims, got shape {fmt_shape(input.shape)}")
    d1, d2 = _dim(dim1, input.ndim, "diagonal"), _dim(dim2, input.ndim, "diagonal")
    if d1 == d2:
        raise ShapeError(f"diagonal: dim1 and dim2 cannot be the same dimension ({dim1}, {dim2})")
    x = input if (d1, d2) == (input.ndim - 2, input.ndim - 1) else input.movedim((d1, d2), (-2, -1))
    return Diagonal.apply(x, int(offset))


def diag_embed(input, offset=0, dim1=-2, dim2=-1):
    """torch.diag_embed: (..., L) -> a tensor with the last dim on the offset diagonal of the (dim1, dim2) planes."""
    no_fp8("diag_embed", input)
    if input.ndim < 1:
        raise ShapeError("diag_embed: expected at least 1 dim, got a 0-d tensor")
    nd = input.ndim + 1
    d1, d2 = _dim(dim1, nd, "diag_embed"), _dim(dim2, nd, "diag_embed")
    if d1 == d2:
        raise ShapeError(f"diag_embed: dim1 and dim2 cannot be the same dimension ({dim1}, {dim2})")
    n = input.shape[-1] + abs(int(offset))
    out = DiagEmbed.apply(input, int(offset), (n, n))
    return out if (d1, d2) == (nd - 2, nd - 1) else out.movedim((-2, -1), (d1, d2))


def diagflat(input, offset=0):
    """torch.diagflat: the flattened input on the `offset`-th diagonal of a square matrix."""
    return diag(input.reshape(-1), offset)


def diag(input, diagonal=0):
    """torch.diag: a 1-D input becomes a square matrix with it on the `diagonal`-th diagonal; a 2-D input gives
    its `diagonal`-th diagonal as a 1-D tensor."""
    if input.ndim == 1:
        return diag_embed(input, diagonal)
    if input.ndim == 2:
        return Diagonal.apply(input, int(diagonal))
    raise ShapeError(f"diag: expected a 1-D or 2-D tensor, got shape {fmt_shape(input.shape)}")


def trace(input):
    """Sum of the main diagonal of a 2-D tensor."""
    if input.ndim != 2:
        raise ShapeError(f"trace: expected a 2-D tensor, got shape {fmt_shape(input.shape)}")
    return Diagonal.apply(input, 0).sum()
