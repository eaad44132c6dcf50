"""LU factorisation with partial pivoting, LAPACK's getrf conventions (PyTorch's): lu_factor / lu_factor_ex give the
packed LU (L's strict lower triangle with a unit diagonal, U on and above it) and the 1-based pivots (row k was
swapped with row pivots[k]); lu gives P, L, U with A = P L U; lu_solve solves with the factors; lu_unpack unpacks
them. Any shape (*, m, n), batched.

The factorisation is right-looking elimination written in differentiable ops: each step picks the pivot (the
largest magnitude in the column, on the arrays), swaps the rows (a gather: the gradient follows the swap), scales
the column and updates the trailing block. So its gradient is exact for every shape and rank, and twice
differentiable; a column whose pivot is zero is left unscaled and reported in info, as LAPACK does."""
import collections

import numpy as np

from ..errors import ShapeError
from ..tensor import _wrap
from ._common import LinAlgError, check_matrix

lu_factor_result = collections.namedtuple("lu_factor", ["LU", "pivots"])
lu_factor_ex_result = collections.namedtuple("lu_factor_ex", ["LU", "pivots", "info"])
lu_result = collections.namedtuple("lu", ["P", "L", "U"])


def _factor(A, pivot):
    """(packed LU, pivots (*, k) int32 1-based, info (*) int32)."""
    from ..ops.shape import cat
    xp = A._xp()
    m, n = A.shape[-2:]
    k_steps = min(m, n)
    batch = tuple(A.shape[:-2])
    R = A
    pivots = xp.broadcast_to(xp.arange(1, k_steps + 1, dtype=np.int32), batch + (k_steps,)).copy()
    info = xp.zeros(batch, dtype=np.int32)
    rows = xp.arange(m)
    for k in range(k_steps):
        if pivot:
            col = xp.abs(R._data[..., k:, k])
            p = xp.argmax(col, axis=-1) + k                              # ties: the first, as LAPACK's idamax
            pivots[..., k] = p + 1
            # swap rows k and p of every matrix (a gather, so the gradient follows), without asking the device
            # whether any row moves: no host sync per column
            order = xp.broadcast_to(rows, batch + (m,)).copy().reshape(-1, m)
            order[xp.arange(order.shape[0]), p.reshape(-1)] = k
            order[:, k] = p.reshape(-1)
            index = xp.broadcast_to(order.reshape(batch + (m, 1)), batch + (m, n))
            R = R.gather(-2, _wrap(xp.ascontiguousarray(index)))
        piv = R._data[..., k, k]
        zero = piv == 0
        info = xp.where((info == 0) & zero, k + 1, info)
        if k + 1 == m:
            break
        safe = _wrap(xp.where(zero, 1, 0).astype(piv.dtype)) + R[..., k, k] * _wrap((~zero).astype(piv.dtype))
        l = R[..., k + 1:, k] / safe.unsqueeze(-1)
        lower = R[..., k + 1:, k + 1:] - l.unsqueeze(-1) * R[..., k, k + 1:].unsqueeze(-2)
        below = cat([R[..., k + 1:, :k], l.unsqueeze(-1), lower], -1)
        R = cat([R[..., :k + 1, :], below], -2)
    return R, pivots, info


def lu_factor_ex(A, *, pivot=True, check_errors=False):
    """(LU, pivots, info): info is 0, or k > 0 where U's k-th diagonal entry (1-based) is exactly zero."""
    check_matrix("lu_factor_ex", A)
    LU, pivots, info = _factor(A, pivot)
    if check_errors and bool((info > 0).any()):
        raise LinAlgError(f"linalg.lu_factor_ex: U[{int(info.max()) - 1}, {int(info.max()) - 1}] is zero: the "
                          f"matrix is singular (input of shape {tuple(A.shape)})")
    return lu_factor_ex_result(LU, _wrap(pivots), _wrap(info))


def lu_factor(A, *, pivot=True):
    """(LU, pivots); a singular matrix raises (U has a zero on its diagonal), as PyTorch's."""
    LU, pivots, _ = lu_factor_ex(A, pivot=pivot, check_errors=True)
    return lu_factor_result(LU, pivots)


def _permutation(pivots, m, xp, dtype):
    """P (*, m, m) with A = P L U from LAPACK's sequential swaps (pivots 1-based)."""
    batch = tuple(pivots.shape[:-1])
    piv = pivots.reshape(-1, pivots.shape[-1]).astype(np.int64) - 1
    nb = piv.shape[0]
    order = xp.broadcast_to(xp.arange(m), (nb, m)).copy()   # row i of the factored matrix is A's row order[i]
    b = xp.arange(nb)
    for k in range(piv.shape[1]):
        a, c = order[:, k].copy(), order[b, piv[:, k]].copy()
        order[:, k], order[b, piv[:, k]] = c, a
    P = xp.zeros((nb, m, m), dtype=dtype)
    P[b[:, None], order, xp.arange(m)[None, :]] = 1
    return P.reshape(batch + (m, m))


def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    """(P, L, U) from lu_factor's results (empty tensors for the parts not asked for)."""
    m, n = LU_data.shape[-2:]
    k = min(m, n)
    xp = LU_data._xp()
    empty = LU_data.new_zeros((0,))
    if unpack_data:
        from ..ops.creation import eye
        L = LU_data[..., :, :k].tril(-1) + eye(m, k, dtype=LU_data.dtype, device=LU_data.device)
        U = LU_data[..., :k, :].triu()
    else:
        L = U = empty
    P = _wrap(_permutation(LU_pivots._data, m, xp, LU_data._data.dtype)) if unpack_pivots else empty
    return lu_result(P, L, U)


def lu(A, *, pivot=True):
    """(P, L, U) with A = P L U: P a permutation, L (*, m, k) unit lower, U (*, k, n) upper, k = min(m, n)."""
    check_matrix("lu", A)
    LU, pivots, _ = _factor(A, pivot)
    return lu_unpack(LU, _wrap(pivots))


def lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    """The solution X of A X = B (left) or X A = B with A given by lu_factor's results; adjoint solves with A^T."""
    from .matrix_functions import solve_triangular
    n = LU.shape[-1]
    if LU.shape[-2] != n:
        raise ShapeError(f"linalg.lu_solve: LU must be square, got shape {tuple(LU.shape)}")
    if not left:   # X A = B  <=>  A^T X^T = B^T
        return lu_solve(LU, pivots, B.mT, left=True, adjoint=not adjoint).mT
    P, L, U = lu_unpack(LU, pivots)
    if not adjoint:   # P L U X = B
        Y = solve_triangular(L, P.mT @ B, upper=False, unitriangular=True)
        return solve_triangular(U, Y, upper=True)
    Y = solve_triangular(U.mT, B, upper=False)    # U^T L^T P^T X = B
    return P @ solve_triangular(L.mT, Y, upper=True, unitriangular=True)
