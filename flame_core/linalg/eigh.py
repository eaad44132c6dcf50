"""linalg.eigh and linalg.eigvalsh: the eigenvalues (ascending) and orthonormal eigenvectors of symmetric matrices
(the triangle named by UPLO is read), differentiable: with F[i, j] = 1 / (l_j - l_i) off the diagonal,
gA = V (diag(gL) + F * (V^T gV)) V^T, symmetrised (the function is one of symmetric matrices). Eigenvector gradients
need distinct eigenvalues (PyTorch: the same; here the terms of equal eigenvalues are dropped, as svd's)."""
import collections

from .. import backend
from ..autograd.function import Function
from ..errors import ShapeError
from ..tensor import _wrap
from ._common import check_matrix, lapack_errors

eigh_result = collections.namedtuple("eigh", ["eigenvalues", "eigenvectors"])


def _eigh_arrays(A, UPLO, values_only):
    xp = backend.xp_of(A._data)
    with lapack_errors("eigh", A.shape, "the eigensolver did not converge"):
        a = xp.ascontiguousarray(A._data)
        if values_only:
            return xp.linalg.eigvalsh(a, UPLO=UPLO), None
        return xp.linalg.eigh(a, UPLO=UPLO)


class _Eigh(Function):
    @staticmethod
    def forward(ctx, A, UPLO):
        w, v = _eigh_arrays(A, UPLO, False)
        L, V = _wrap(w), _wrap(v)
        ctx.save_for_backward(L, V)
        return L, V

    @staticmethod
    def backward(ctx, gL, gV):
        from ..ops.matrix import diag_embed
        L, V = ctx.saved_tensors
        E = L.unsqueeze(-2) - L.unsqueeze(-1)             # E[i, j] = l_j - l_i
        E = E.masked_fill(E == 0, float("inf"))
        inner = (V.mT @ gV) / E + diag_embed(gL)
        gA = V @ inner @ V.mT
        return (gA + gA.mT) * 0.5, None


class _Eigvalsh(Function):
    @staticmethod
    def forward(ctx, A, UPLO):
        need = ctx.needs_input_grad[0]
        w, v = _eigh_arrays(A, UPLO, not need)
        if need:
            ctx.save_for_backward(_wrap(v))
        return _wrap(w)

    @staticmethod
    def backward(ctx, gL):
        (V,) = ctx.saved_tensors
        return (V * gL.unsqueeze(-2)) @ V.mT, None


def _uplo(op, UPLO):
    if UPLO not in ("L", "U"):
        raise ShapeError(f"linalg.{op}: UPLO must be 'L' or 'U', got {UPLO!r}")
    return UPLO


def eigh(A, UPLO="L"):
    """(eigenvalues (*, n) ascending, eigenvectors (*, n, n) as columns) of the symmetric matrices of A."""
    check_matrix("eigh", A, square=True)
    return eigh_result(*_Eigh.apply(A, _uplo("eigh", UPLO)))


def eigvalsh(A, UPLO="L"):
    check_matrix("eigvalsh", A, square=True)
    return _Eigvalsh.apply(A, _uplo("eigvalsh", UPLO))
