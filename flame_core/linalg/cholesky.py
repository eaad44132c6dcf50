"""linalg.cholesky: A = L L^T for symmetric positive-definite A (the lower triangle is read), differentiable with
PyTorch's rule (I. Murray, "Differentiation of the Cholesky decomposition", 2016): with P = tril(L^T gL),
gA = L^-T (P + tril(P, -1)^T) / 2 L^-1, symmetric. LinAlgError when a matrix is not positive-definite."""
import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import _wrap
from ._common import check_matrix, lapack_errors
from .solve import solve


class _Cholesky(Function):
    @staticmethod
    def forward(ctx, A):
        xp = backend.xp_of(A._data)
        a = xp.ascontiguousarray(A._data)
        lower = xp.tril(a) + xp.swapaxes(xp.tril(a, -1), -1, -2)   # the lower triangle, as LAPACK's potrf reads it
        with lapack_errors("cholesky", A.shape, "the matrix is not positive-definite"):
            L = _wrap(xp.linalg.cholesky(lower))
        if xp is not np and bool(xp.isnan(L._data).any()):   # cuSOLVER reports failure as NaN
            from ._common import LinAlgError
            raise LinAlgError(f"linalg.cholesky: the matrix is not positive-definite (input of shape "
                              f"{tuple(A.shape)})")
        ctx.save_for_backward(L)
        return L

    @staticmethod
    def backward(ctx, g):
        (L,) = ctx.saved_tensors
        P = (L.mT @ g).tril()
        S = (P + P.tril(-1).mT) * 0.5
        Y = solve(L.mT, S)                      # L^-T S
        return solve(L.mT, Y.mT).mT             # (L^-T S) L^-1


def cholesky(A, *, upper=False):
    """The Cholesky factor of each symmetric positive-definite matrix of A (*, n, n): lower L with A = L L^T, or
    upper U = L^T with A = U^T U."""
    check_matrix("cholesky", A, square=True)
    L = _Cholesky.apply(A)
    return L.mT if upper else L
