"""linalg.matrix_exp: e^A for square matrices (*, n, n) by scaling and squaring -- A / 2^s with a norm at most 1/2,
its Taylor series to degree 18 (the remainder under 1e-20 of the sum), then s squarings -- in differentiable ops, so
the gradient is that of the computation (within rounding of the exact Frechet derivative PyTorch evaluates)."""
import math

from ..errors import ShapeError
from ._common import check_matrix

_DEGREE = 18


def matrix_exp(A):
    check_matrix("matrix_exp", A, square=True)
    if A.ndim < 2:
        raise ShapeError(f"linalg.matrix_exp: expected a (*, n, n) tensor, got shape {tuple(A.shape)}")
    n = A.shape[-1]
    from ..ops.creation import eye
    eye_n = eye(n, dtype=A.dtype, device=A.device)
    if A.numel() == 0:
        return A.clone()
    norm = float(A.detach().abs().sum(-2).amax().item())   # the largest 1-norm over the batch
    s = max(0, math.ceil(math.log2(norm / 0.5))) if norm > 0.5 else 0
    X = A / (2.0 ** s) if s else A
    term, out = eye_n, eye_n
    for k in range(1, _DEGREE + 1):
        term = (term @ X) / k
        out = out + term
    for _ in range(s):
        out = out @ out
    return out
