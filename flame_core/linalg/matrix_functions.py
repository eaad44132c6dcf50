"""PyTorch's other torch.linalg functions, composed of differentiable ops: matrix_power, multi_dot, vecdot, cross,
diagonal, pinv (through the SVD), matrix_rank, solve_triangular (a solve on the named triangle)."""
from ..errors import ShapeError
from ..tensor import Tensor
from ._common import check_matrix
from .solve import inv, solve
from .svd import svd, svdvals


def matrix_power(A, n):
    """A^n for square matrices (*, n, n) by repeated squaring; n = 0 the identity, n < 0 powers of the inverse."""
    if A.ndim < 2 or A.shape[-1] != A.shape[-2]:
        raise ShapeError(f"linalg.matrix_power: expected square matrices, got shape {tuple(A.shape)}")
    if not isinstance(n, int):
        raise TypeError(f"linalg.matrix_power: n must be an int, got {type(n).__name__}")
    if n == 0:
        from ..ops.creation import eye
        return eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(tuple(A.shape)).clone()
    base = inv(A) if n < 0 else A
    n = abs(n)
    result = None
    while n:
        if n & 1:
            result = base if result is None else result @ base
        n >>= 1
        if n:
            base = base @ base
    return result


def multi_dot(tensors):
    """The product of a list of matrices (the first may be 1-D: a row; the last 1-D: a column), left to right."""
    ts = list(tensors)
    if len(ts) < 2:
        raise ValueError(f"linalg.multi_dot: expects at least 2 tensors, got {len(ts)}")
    if any(t.ndim not in (1, 2) for t in ts) or any(t.ndim != 2 for t in ts[1:-1]):
        raise ShapeError(f"linalg.multi_dot: the first and last tensors may be 1-D or 2-D, the others 2-D; got "
                         f"{[tuple(t.shape) for t in ts]}")
    out = ts[0]
    for t in ts[1:]:
        out = out @ t
    return out


def vecdot(x, y, *, dim=-1):
    """The dot product of x and y along dim (broadcast elsewhere)."""
    return (x * y).sum(dim)


def cross(input, other, *, dim=-1):
    """The cross product of 3-vectors along dim (default the last), as torch.linalg.cross."""
    from ..ops.products import cross as _cross
    return _cross(input, other, dim=dim)


def diagonal(A, *, offset=0, dim1=-2, dim2=-1):
    from ..ops.matrix import diagonal as _diagonal
    return _diagonal(A, offset, dim1, dim2)


def _tolerance(S, atol, rtol, m, n, dtype):
    """PyTorch's cutoff max(atol, rtol * max(S)); rtol defaults to eps * max(m, n) when neither is given."""
    import numpy as np
    if rtol is None:
        rtol = 0.0 if atol is not None and atol > 0 else float(np.finfo(dtype.np).eps) * max(m, n)
    smax = S.amax(-1, keepdim=True) if S.shape[-1] else S.sum(-1, keepdim=True)
    tol = smax * rtol
    if atol is not None:
        tol = tol.clamp(min=float(atol))
    return tol


def pinv(A, *, atol=None, rtol=None, hermitian=False):
    """The Moore-Penrose pseudo-inverse of A (*, m, n) -> (*, n, m) through the SVD: singular values at or below
    max(atol, rtol * max(S)) are treated as zero (rtol default: eps * max(m, n)). hermitian is accepted and
    computed the same way (the SVD of a symmetric matrix)."""
    check_matrix("pinv", A)
    from ..ops import elementwise as E
    U, S, Vh = svd(A, full_matrices=False)
    tol = _tolerance(S.detach(), atol, rtol, A.shape[-2], A.shape[-1], A.dtype)
    keep = S > tol
    s_inv = E.where(keep, 1.0 / E.where(keep, S, 1.0), 0.0)
    return (Vh.mT * s_inv.unsqueeze(-2)) @ U.mT


def matrix_rank(A, *, atol=None, rtol=None, hermitian=False):
    """The number of singular values above max(atol, rtol * max(S)) per matrix (int64)."""
    check_matrix("matrix_rank", A)
    S = svdvals(A.detach())
    tol = _tolerance(S, atol, rtol, A.shape[-2], A.shape[-1], A.dtype)
    return (S > tol).sum(-1)


def pinverse(input, rcond=1e-15):
    """torch.pinverse: pinv with rtol = rcond."""
    return pinv(input, rtol=rcond)


def solve_triangular(A, B, *, upper, left=True, unitriangular=False):
    """The solution X of A X = B (left) or X A = B, reading only A's upper (upper=True) or lower triangle (and a
    unit diagonal with unitriangular=True); A (*, n, n), B (*, n, k) / (*, k, n)."""
    check_matrix("solve_triangular", A, square=True)
    if not isinstance(B, Tensor) or B.ndim < 2:
        raise ShapeError("linalg.solve_triangular: B must be a tensor of at least 2 dims")
    T = A.triu() if upper else A.tril()
    if unitriangular:
        from ..ops.creation import eye
        eye_n = eye(A.shape[-1], dtype=A.dtype, device=A.device)
        T = T * (1 - eye_n) + eye_n
    return solve(T, B, left=left)


def cond(A, p=None):
    """The condition number of A in the norm p: None / 2 / -2 from the singular values (inf for a singular matrix at
    p = None / 2), 'fro' / 'nuc' / 1 / -1 / inf / -inf as norm(A) * norm(A^-1) (inf where A is singular)."""
    from ..ops import elementwise as E
    from .checked import inv_ex
    from .norms import matrix_norm
    check_matrix("cond", A)
    if p is None or p in (2, -2):
        S = svdvals(A)
        big, small = S[..., 0], S[..., -1]
        return big / small if p != -2 else small / big
    if p not in ("fro", "nuc", 1, -1, float("inf"), float("-inf")):
        raise ValueError(f"linalg.cond: p must be None, 2, -2, 'fro', 'nuc', 1, -1, inf or -inf, got {p!r}")
    check_matrix("cond", A, square=True)
    Ainv, info = inv_ex(A)
    out = matrix_norm(A, p) * matrix_norm(Ainv.nan_to_num(0.0), p)
    return E.where(info > 0, float("inf"), out)


def vander(x, *, N=None):
    """linalg.vander: (*, n) -> (*, n, N) with the increasing powers x^0 .. x^(N-1) (N defaults to n), as running
    products."""
    from ..ops.shape import cat
    if x.ndim < 1:
        raise ShapeError("linalg.vander: x must have at least one dimension")
    N = x.shape[-1] if N is None else N
    if N < 2:
        raise ValueError(f"linalg.vander: N must be greater than 1, got {N}")
    cols = cat([x.new_ones(tuple(x.shape) + (1,)), x.unsqueeze(-1).expand(tuple(x.shape) + (N - 1,))], -1)
    return cols.cumprod(-1)


def tensorinv(A, ind=2):
    """The 'inverse' of A with respect to tensordot over its first `ind` dims: A reshaped to a square matrix,
    inverted, reshaped to A.shape[ind:] + A.shape[:ind]."""
    import math
    if ind <= 0:
        raise ValueError(f"linalg.tensorinv: expected a strictly positive integer for 'ind', got {ind}")
    left, right = tuple(A.shape[:ind]), tuple(A.shape[ind:])
    if math.prod(left) != math.prod(right):
        raise ShapeError(f"linalg.tensorinv: the product of the first {ind} dims of A {tuple(A.shape)} must equal "
                         f"the product of the rest")
    return inv(A.reshape(math.prod(left), math.prod(right))).reshape(right + left)


def tensorsolve(A, B, dims=None):
    """X with tensordot(A, X, X.ndim) = B: A's dims `dims` moved to the end first; X has A's trailing shape."""
    import math
    if dims is not None:
        d = [k % A.ndim for k in dims]
        A = A.permute(*[k for k in range(A.ndim) if k not in d], *d)
    rest = tuple(A.shape[B.ndim:])
    if tuple(A.shape[:B.ndim]) != tuple(B.shape) or math.prod(rest) != B.numel():
        raise ShapeError(f"linalg.tensorsolve: A {tuple(A.shape)} does not fit B {tuple(B.shape)} (A's leading "
                         f"dims must be B's, and its other dims hold as many elements)")
    return solve(A.reshape(B.numel(), B.numel()), B.reshape(-1)).reshape(rest)
