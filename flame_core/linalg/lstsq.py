"""linalg.lstsq: the least-squares solutions X minimising ||A X - B|| (the minimum-norm one where A is
rank-deficient), through the pseudo-inverse (the SVD), so differentiable in A and B. The other results follow
PyTorch's per-driver rules: rank for gelsy / gelsd / gelss, singular_values for gelsd / gelss, residuals (the
squared column norms of A X - B) for gels / gelsd / gelss when m > n and every matrix has full rank; empty tensors
otherwise. driver=None is gelsy."""
import collections

import numpy as np

from ..errors import ShapeError
from ._common import check_matrix

lstsq_result = collections.namedtuple("lstsq", ["solution", "residuals", "rank", "singular_values"])
_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def lstsq(A, B, rcond=None, *, driver=None):
    from .. import dtypes as D
    from .matrix_functions import pinv
    from .svd import svdvals
    check_matrix("lstsq", A)
    driver = "gelsy" if driver is None else driver
    if driver not in _DRIVERS:
        raise ValueError(f"linalg.lstsq: driver must be one of {_DRIVERS}, got {driver!r}")
    vector = B.ndim == A.ndim - 1
    Bm = B.unsqueeze(-1) if vector else B
    if Bm.ndim < 2 or Bm.shape[-2] != A.shape[-2]:
        raise ShapeError(f"linalg.lstsq: A {tuple(A.shape)} and B {tuple(B.shape)} do not fit (B needs "
                         f"{A.shape[-2]} rows)")
    m, n = A.shape[-2:]
    rtol = float(np.finfo(A.dtype.np).eps) * max(m, n) if rcond is None or rcond < 0 else rcond
    X = pinv(A, rtol=rtol) @ Bm
    S = svdvals(A.detach())
    rank = (S > rtol * S.amax(-1, keepdim=True)).sum(-1)
    empty = A.new_zeros((0,))
    residuals = empty
    if driver != "gelsy" and m > n and bool((rank == n).all()):
        residuals = ((A @ X - Bm) ** 2).sum(-2)
    return lstsq_result(X.squeeze(-1) if vector else X, residuals.squeeze(-1) if vector and residuals.numel() else
                        residuals, rank.to(D.int64) if driver != "gels" else empty.to(D.int64),
                        S if driver in ("gelsd", "gelss") else empty)
