"""linalg.svd (U, S, Vh) and linalg.svdvals, differentiable (real matrices).

The backward is the standard one (PyTorch's svd_backward; J. Townsend, "Differentiating the singular value
decomposition"). Gradients through U and Vh are defined only for distinct singular values; where two are equal the
terms that would divide by zero are dropped (PyTorch returns inf / NaN there), so a loss of S alone keeps its
exact gradient U diag(gS) Vh. With full_matrices=True the gradients of the extra columns of U / rows of Vh are
ignored, as in PyTorch (those vectors are an arbitrary basis)."""
import collections

from .. import backend
from ..autograd.function import Function
from ..tensor import _wrap
from ._common import check_matrix, lapack_errors

svd_result = collections.namedtuple("svd", ["U", "S", "Vh"])


class _Svd(Function):
    @staticmethod
    def forward(ctx, A, full_matrices):
        xp = backend.xp_of(A._data)
        with lapack_errors("svd", A.shape, "the SVD did not converge"):
            u, s, vh = xp.linalg.svd(xp.ascontiguousarray(A._data), full_matrices=full_matrices)
        U, S, Vh = _wrap(u), _wrap(s), _wrap(vh)
        ctx.save_for_backward(U, S, Vh)
        return U, S, Vh

    @staticmethod
    def backward(ctx, gU, gS, gVh):
        U, S, Vh = ctx.saved_tensors
        return svd_backward(U, S, Vh, gU, gS, gVh), None


def svd_backward(U, S, Vh, gU, gS, gVh):
    from ..ops.matrix import diag_embed
    k = S.shape[-1]
    m, n = U.shape[-2], Vh.shape[-1]
    if U.shape[-1] != k:  # full_matrices: only the first k singular vectors enter
        U, gU = U[..., :k], gU[..., :k]
    if Vh.shape[-2] != k:
        Vh, gVh = Vh[..., :k, :], gVh[..., :k, :]
    skew_u = U.mT @ gU
    skew_u = skew_u - skew_u.mT
    skew_v = Vh @ gVh.mT
    skew_v = skew_v - skew_v.mT
    S2 = S * S
    E = S2.unsqueeze(-2) - S2.unsqueeze(-1)          # E[i, j] = s_j^2 - s_i^2
    E = E.masked_fill(E == 0, float("inf"))           # the diagonal (skew parts are 0 there) and repeated values
    inner = (skew_u * S.unsqueeze(-2) + S.unsqueeze(-1) * skew_v) / E + diag_embed(gS)
    if m > k:    # U is tall: the part of gU outside U's column space
        gUS = gU / S.unsqueeze(-2)
        return (U @ inner + gUS - U @ (U.mT @ gUS)) @ Vh
    if n > k:    # Vh is wide: the part of gVh outside its row space
        SgVh = gVh / S.unsqueeze(-1)
        return U @ (inner @ Vh + SgVh - (SgVh @ Vh.mT) @ Vh)
    return U @ inner @ Vh


class _SvdVals(Function):
    @staticmethod
    def forward(ctx, A):
        xp = backend.xp_of(A._data)
        with lapack_errors("svdvals", A.shape, "the SVD did not converge"):
            if ctx.needs_input_grad[0]:
                u, s, vh = xp.linalg.svd(xp.ascontiguousarray(A._data), full_matrices=False)
                ctx.save_for_backward(_wrap(u), _wrap(vh))
            else:
                s = xp.linalg.svd(xp.ascontiguousarray(A._data), compute_uv=False)
        return _wrap(s)

    @staticmethod
    def backward(ctx, gS):
        U, Vh = ctx.saved_tensors
        return (U * gS.unsqueeze(-2)) @ Vh


def svd(A, full_matrices=True):
    """A = U diag(S) Vh for A (*, m, n): U (*, m, m) (or (*, m, k) with full_matrices=False), S (*, k) descending,
    Vh (*, n, n) (or (*, k, n)); k = min(m, n)."""
    check_matrix("svd", A)
    return svd_result(*_Svd.apply(A, bool(full_matrices)))


def svdvals(A):
    """The singular values of A (*, m, n), descending: (*, k). Gradient U diag(gS) Vh."""
    check_matrix("svdvals", A)
    return _SvdVals.apply(A)
