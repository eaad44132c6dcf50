"""linalg.det and linalg.slogdet (and torch.logdet), differentiable: d det(A) = det(A) tr(A^-1 dA), so the gradient
of det is g det(A) A^-T and that of log|det| is g A^-T (PyTorch's rules for invertible A; for a singular A the
backward raises LinAlgError, where PyTorch goes through an SVD)."""
import collections

from .. import backend
from ..autograd.function import Function
from ..tensor import _wrap
from ._common import check_matrix, lapack_errors
from .solve import inv

slogdet_result = collections.namedtuple("slogdet", ["sign", "logabsdet"])


class _Det(Function):
    @staticmethod
    def forward(ctx, A):
        xp = backend.xp_of(A._data)
        with lapack_errors("det", A.shape, "the LU factorisation failed"):
            d = _wrap(xp.asarray(xp.linalg.det(xp.ascontiguousarray(A._data))).astype(A._data.dtype))
        ctx.save_for_backward(A, d)
        return d

    @staticmethod
    def backward(ctx, g):
        A, d = ctx.saved_tensors
        return (g * d).unsqueeze(-1).unsqueeze(-1) * inv(A).mT


class _Slogdet(Function):
    @staticmethod
    def forward(ctx, A):
        xp = backend.xp_of(A._data)
        with lapack_errors("slogdet", A.shape, "the LU factorisation failed"):
            s, ld = xp.linalg.slogdet(xp.ascontiguousarray(A._data))
        dt = A._data.dtype
        sign, logabs = _wrap(xp.asarray(s).astype(dt)), _wrap(xp.asarray(ld).astype(dt))
        ctx.mark_non_differentiable(sign)
        ctx.save_for_backward(A)
        return sign, logabs

    @staticmethod
    def backward(ctx, _gs, g):
        (A,) = ctx.saved_tensors
        return g.unsqueeze(-1).unsqueeze(-1) * inv(A).mT


def det(A):
    """The determinant of each square matrix of A (*, n, n) -> (*)."""
    check_matrix("det", A, square=True)
    return _Det.apply(A)


def slogdet(A):
    """(sign, log|det|) of each square matrix of A (*, n, n): the log without overflow; sign 0 and -inf for a
    singular matrix. Differentiable in logabsdet."""
    check_matrix("slogdet", A, square=True)
    return slogdet_result(*_Slogdet.apply(A))


def logdet(A):
    """log det(A): NaN where det(A) < 0, -inf where it is 0, as torch.logdet."""
    sign, logabs = slogdet(A)
    from ..ops import elementwise as E
    return E.where(sign < 0, float("nan"), E.where(sign == 0, float("-inf"), logabs))
