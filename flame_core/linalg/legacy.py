"""PyTorch's older linear-algebra functions in the torch namespace, with their own signatures, on top of
torch.linalg's: torch.svd (V, not V^H; some / compute_uv), torch.qr (some), torch.cholesky (upper),
cholesky_solve, cholesky_inverse, triangular_solve (returning the solution and a copy of A), lu / lu_solve and
lu_unpack (lu.py's). Differentiable as
the functions they are made of."""
import collections

from .cholesky import cholesky as _cholesky
from .lu import lu_unpack  # noqa: F401  (torch.lu_unpack)
from .matrix_functions import solve_triangular
from .qr import qr as _qr
from .svd import svd as _svd

svd_result = collections.namedtuple("svd", ["U", "S", "V"])
qr_result = collections.namedtuple("qr", ["Q", "R"])
triangular_solve_result = collections.namedtuple("triangular_solve", ["solution", "cloned_coefficient"])


def svd(input, some=True, compute_uv=True):
    """(U, S, V) with input = U diag(S) V^T; some=True: the reduced factors; compute_uv=False: U and V are zeros
    (the full factors' shapes when some=False), as PyTorch's."""
    if not compute_uv:
        from ..ops.creation import zeros
        from .svd import svdvals
        m, n = input.shape[-2:]
        k = min(m, n)
        batch = tuple(input.shape[:-2])
        u_cols, v_cols = (k, k) if some else (m, n)
        return svd_result(zeros(batch + (m, u_cols), dtype=input.dtype, device=input.device), svdvals(input),
                          zeros(batch + (n, v_cols), dtype=input.dtype, device=input.device))
    U, S, Vh = _svd(input, full_matrices=not some)
    return svd_result(U, S, Vh.mT)


def qr(input, some=True):
    Q, R = _qr(input, mode="reduced" if some else "complete")
    return qr_result(Q, R)


def cholesky(input, upper=False):
    """The Cholesky factor L (A = L L^T), or U = L^T with upper=True."""
    return _cholesky(input, upper=upper)


def cholesky_solve(B, L, upper=False):
    """X with A X = B, A given by its Cholesky factor (lower L: A = L L^T; upper=True: A = U^T U)."""
    if upper:
        return solve_triangular(L, solve_triangular(L.mT, B, upper=False), upper=True)
    return solve_triangular(L.mT, solve_triangular(L, B, upper=False), upper=True)


def cholesky_inverse(L, upper=False):
    """The inverse of A from its Cholesky factor."""
    from ..ops.creation import eye
    n = L.shape[-1]
    return cholesky_solve(eye(n, dtype=L.dtype, device=L.device).expand(tuple(L.shape)), L, upper=upper)


def triangular_solve(b, A, upper=True, transpose=False, unitriangular=False):
    """(X, A.clone()) with op(A) X = b, op(A) = A or A^T (transpose), reading A's upper or lower triangle."""
    T = A.mT if transpose else A
    X = solve_triangular(T, b, upper=upper != transpose, unitriangular=unitriangular)
    return triangular_solve_result(X, A.clone())


def lu(A, pivot=True, get_infos=False):
    """torch.lu: (A_LU, pivots) or (A_LU, pivots, infos): linalg.lu_factor_ex's results."""
    from .lu import lu_factor_ex
    LU, pivots, info = lu_factor_ex(A, pivot=pivot)
    if not get_infos and bool((info > 0).any()):
        from ._common import LinAlgError
        raise LinAlgError(f"torch.lu: the matrix is singular (U[{int(info.max()) - 1}, {int(info.max()) - 1}] is "
                          f"zero); pass get_infos=True to get the infos instead")
    return (LU, pivots, info) if get_infos else (LU, pivots)


def lu_solve(b, LU_data, LU_pivots):
    """torch.lu_solve: the solution of A x = b from torch.lu's factors (linalg.lu_solve's argument order differs)."""
    from .lu import lu_solve as _lu_solve
    return _lu_solve(LU_data, LU_pivots, b)
