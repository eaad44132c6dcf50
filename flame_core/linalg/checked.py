"""The *_ex forms of torch.linalg, which report a failing matrix in an `info` tensor instead of raising (unless
check_errors=True): cholesky_ex (info: the order of the first leading minor that is not positive-definite), inv_ex
and solve_ex (info: the 1-based index of U's first zero pivot, from the LU factorisation). The results of the
matrices that fail are NaN (PyTorch leaves them unspecified); the others are the plain functions' (differentiable)."""
import collections

import numpy as np

from .. import backend
from ..tensor import _wrap
from ._common import LinAlgError, check_matrix

cholesky_ex_result = collections.namedtuple("cholesky_ex", ["L", "info"])
inv_ex_result = collections.namedtuple("inv_ex", ["inverse", "info"])
solve_ex_result = collections.namedtuple("solve_ex", ["result", "info"])


def _cholesky_info(a):
    """Per matrix of a (*, n, n) host array: 0, or the order of its first leading minor that is not positive
    definite (one batched factorisation; the matrices are tried one by one only when it fails)."""
    lower = np.tril(a) + np.swapaxes(np.tril(a, -1), -1, -2)
    info = np.zeros(a.shape[:-2], dtype=np.int32)
    try:
        np.linalg.cholesky(lower)
        return info
    except np.linalg.LinAlgError:
        pass
    flat, out = lower.reshape(-1, *a.shape[-2:]), info.reshape(-1)
    for b, m in enumerate(flat):
        out[b] = next((k for k in range(1, m.shape[0] + 1) if not _positive_definite(m[:k, :k])), 0)
    return info


def _positive_definite(m):
    try:
        np.linalg.cholesky(m)
        return True
    except np.linalg.LinAlgError:
        return False


def _lu_info(A):
    from ..autograd.grad_mode import no_grad
    from .lu import _factor
    with no_grad():
        return _factor(A.detach(), True)[2]


def _safe(A, info):
    """(A with the failing matrices (info > 0) swapped for identities, the failing mask as a tensor)."""
    from ..ops import elementwise as E
    from ..ops.creation import eye
    bad = _wrap(A._xp().asarray(info > 0))
    eye_n = eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return E.where(bad.reshape(tuple(bad.shape) + (1, 1)), eye_n, A), bad


def _nan_where(bad, out):
    from ..ops import elementwise as E
    return E.where(bad.reshape(tuple(bad.shape) + (1,) * (out.ndim - bad.ndim)), float("nan"), out)


def _raise(op, info, what):
    if bool((info > 0).any()):
        raise LinAlgError(f"linalg.{op}: {what} (info {int(info.max())})")


def cholesky_ex(A, *, upper=False, check_errors=False):
    from .cholesky import cholesky
    check_matrix("cholesky_ex", A, square=True)
    info = _cholesky_info(backend.to_numpy(A.detach()._data).astype(np.float64))
    if check_errors:
        _raise("cholesky_ex", info, "the matrix is not positive-definite")
    info = A._xp().asarray(info)
    if not bool(info.any()):
        return cholesky_ex_result(cholesky(A, upper=upper), _wrap(info))
    safe, bad = _safe(A, info)
    return cholesky_ex_result(_nan_where(bad, cholesky(safe, upper=upper)), _wrap(info))


def inv_ex(A, *, check_errors=False):
    from .solve import inv
    check_matrix("inv_ex", A, square=True)
    info = _lu_info(A)
    if check_errors:
        _raise("inv_ex", info, "the matrix is singular")
    if not bool(info.any()):
        return inv_ex_result(inv(A), _wrap(info))
    safe, bad = _safe(A, info)
    return inv_ex_result(_nan_where(bad, inv(safe)), _wrap(info))


def solve_ex(A, B, *, left=True, check_errors=False):
    from .solve import solve
    check_matrix("solve_ex", A, square=True)
    info = _lu_info(A)
    if check_errors:
        _raise("solve_ex", info, "the matrix is singular")
    if not bool(info.any()):
        return solve_ex_result(solve(A, B, left=left), _wrap(info))
    safe, bad = _safe(A, info)
    return solve_ex_result(_nan_where(bad, solve(safe, B, left=left)), _wrap(info))
