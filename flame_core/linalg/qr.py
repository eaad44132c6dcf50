"""linalg.qr: A = Q R with Q's columns orthonormal and R upper triangular (LAPACK's Householder signs), modes
"reduced" (Q (*, m, k), R (*, k, n), k = min(m, n)), "complete" (Q (*, m, m)) and "r" (R only, Q empty).

Differentiable but in mode "r" and in "complete" mode for m > n, as PyTorch:
with M = R gR^T - gQ^T Q, gA = (gQ + Q copyltu(M)) R^-T, copyltu(M) the symmetric matrix of M's lower triangle
(M. Seeger et al., "Auto-differentiating linear algebra"). Other cases raise in backward, as in PyTorch."""
import collections

from .. import backend
from ..autograd.function import Function
from ..errors import ShapeError
from ..tensor import _wrap
from ._common import check_matrix, lapack_errors
from .solve import solve

qr_result = collections.namedtuple("qr", ["Q", "R"])


class _Qr(Function):
    @staticmethod
    def forward(ctx, A, mode):
        xp = backend.xp_of(A._data)
        with lapack_errors("qr", A.shape, "the factorisation failed"):
            if mode == "r":
                r = xp.linalg.qr(xp.ascontiguousarray(A._data), mode="r")
                q = xp.zeros((0,), dtype=A._data.dtype)
            else:
                q, r = xp.linalg.qr(xp.ascontiguousarray(A._data), mode=mode)
        Q, R = _wrap(q), _wrap(r)
        ctx.save_for_backward(Q, R)
        ctx.mode, ctx.m, ctx.n = mode, A.shape[-2], A.shape[-1]
        return Q, R

    @staticmethod
    def backward(ctx, gQ, gR):
        Q, R = ctx.saved_tensors
        m, n, mode = ctx.m, ctx.n, ctx.mode
        if mode == "r":
            raise RuntimeError("linalg.qr: the derivative of mode='r' is not defined (it needs Q): use "
                               "mode='reduced'")
        if mode == "complete" and m > n:
            raise RuntimeError(f"linalg.qr: mode='complete' is not differentiable for a tall matrix ((m, n) = "
                               f"({m}, {n}): the extra columns of Q are an arbitrary basis), as in PyTorch: use "
                               f"mode='reduced'")
        if m < n:   # A = Q [R1 R2]: X = A[:, :m] = Q R1 takes the square case; Y = A[:, m:] = Q R2
            R1, R2 = R[..., :, :m], R[..., :, m:]
            gR1, gR2 = gR[..., :, :m], gR[..., :, m:]
            Y = Q @ R2
            gQ2 = gQ + Y @ gR2.mT
            gX = _square_backward(Q, R1, gQ2, gR1)
            gY = Q @ gR2
            from ..ops.shape import cat
            return cat([gX, gY], dim=-1), None
        return _square_backward(Q, R, gQ, gR), None


def _square_backward(Q, R, gQ, gR):
    """gA for A = Q R with R square (m >= n, Q (m, n))."""
    M = R @ gR.mT - gQ.mT @ Q
    lower = M.tril(-1)
    sym = lower + lower.mT + M.diagonal(0, -2, -1).diag_embed()
    B = gQ + Q @ sym
    return solve(R, B.mT).mT            # B R^-T


def qr(A, mode="reduced"):
    """The QR decomposition of A (*, m, n): (Q, R) named as PyTorch's."""
    check_matrix("qr", A)
    if mode not in ("reduced", "complete", "r"):
        raise ShapeError(f"linalg.qr: mode must be 'reduced', 'complete' or 'r', got {mode!r}")
    return qr_result(*_Qr.apply(A, mode))
