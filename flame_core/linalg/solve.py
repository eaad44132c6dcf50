"""linalg.solve and linalg.inv, batched with broadcasting; backward rules written with the same ops, so they are
twice differentiable: X = A^-1 B gives dB = A^-T g, dA = -dB X^T; Y = A^-1 gives dA = -Y^T g Y^T."""
import numpy as np

from .. import backend
from ..autograd.function import Function
from ..errors import DTypeError, ShapeError, fmt_shape
from ..tensor import Tensor, _wrap, check_same_device
from ._common import check_matrix, lapack_errors


class _Solve(Function):
    """A (..., n, n), B (..., n, k) with equal batch dims -> X (..., n, k)."""

    @staticmethod
    def forward(ctx, A, B):
        xp = backend.xp_of(A._data)
        with lapack_errors("solve", A.shape, "A is singular"):
            x = xp.linalg.solve(xp.ascontiguousarray(A._data), xp.ascontiguousarray(B._data))
        X = _wrap(x)
        ctx.save_for_backward(A, X if ctx.needs_input_grad[0] else None)
        return X

    @staticmethod
    def backward(ctx, g):
        A, X = ctx.saved_tensors
        gB = _Solve.apply(A.mT, g)
        gA = -(gB @ X.mT) if ctx.needs_input_grad[0] else None
        return gA, gB


def solve(A, B, *, left=True):
    """The solution X of A X = B (left=True) or X A = B (left=False); A (*, n, n), B (*, n, k) or, for left=True,
    a batch of vectors (*, n) (B 1-D, or B.shape == A.shape[:-1], PyTorch's rule). Batch dims broadcast."""
    check_matrix("solve", A, square=True)
    if not isinstance(B, Tensor):
        raise TypeError(f"linalg.solve: B must be a Tensor, got {type(B).__name__}")
    check_same_device("linalg.solve", A, B)
    if B.dtype != A.dtype:
        raise DTypeError(f"linalg.solve: A and B must have the same dtype, got {A.dtype.name} and {B.dtype.name}")
    vector = B.ndim == 1 or (B.ndim == A.ndim - 1 and tuple(B.shape) == tuple(A.shape[:-1]))
    if not left:
        if vector:
            raise ShapeError(f"linalg.solve: left=False needs B of shape (*, k, n), got {fmt_shape(B.shape)} (a "
                             f"vector right-hand side only works with left=True)")
        return solve(A.mT, B.mT).mT
    Bm = B.unsqueeze(-1) if vector else B
    if Bm.ndim < 2 or Bm.shape[-2] != A.shape[-1]:
        raise ShapeError(f"linalg.solve: A {fmt_shape(A.shape)} and B {fmt_shape(B.shape)} do not fit (B needs "
                         f"{A.shape[-1]} rows)")
    try:
        batch = tuple(np.broadcast_shapes(tuple(A.shape[:-2]), tuple(Bm.shape[:-2])))
    except ValueError:
        raise ShapeError(f"linalg.solve: batch dims of A {fmt_shape(A.shape)} and B {fmt_shape(B.shape)} do not "
                         f"broadcast") from None
    if tuple(A.shape[:-2]) != batch:
        A = A.expand(batch + tuple(A.shape[-2:]))
    if tuple(Bm.shape[:-2]) != batch:
        Bm = Bm.expand(batch + tuple(Bm.shape[-2:]))
    X = _Solve.apply(A, Bm)
    return X.squeeze(-1) if vector else X


class _Inv(Function):
    @staticmethod
    def forward(ctx, A):
        xp = backend.xp_of(A._data)
        with lapack_errors("inv", A.shape, "the matrix is singular"):
            Y = _wrap(xp.linalg.inv(xp.ascontiguousarray(A._data)))
        ctx.save_for_backward(Y)
        return Y

    @staticmethod
    def backward(ctx, g):
        (Y,) = ctx.saved_tensors
        Yt = Y.mT
        return -(Yt @ g @ Yt)


def inv(A):
    """The inverse of each square matrix of A (*, n, n); LinAlgError when one is singular."""
    check_matrix("inv", A, square=True)
    return _Inv.apply(A)
