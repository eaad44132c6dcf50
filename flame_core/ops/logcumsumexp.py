"""logcumsumexp: log(cumsum(exp(x))) along a dim without overflow or underflow, as a log-depth scan of logaddexp
(Hillis-Steele: ceil(log2 n) rounds, each adding in the running value 2^k places back). Every round is differentiable
ops, so the gradient (and the gradient of the gradient) is exact and stable: logaddexp's softmax weights."""
from ..errors import DTypeError
from .math_ops import logaddexp
from .shape import _norm_dim, cat


def logcumsumexp(input, dim):
    if not input.dtype.is_floating_point:
        raise DTypeError(f"logcumsumexp: expected a floating point tensor, got {input.dtype.name}")
    if input.ndim == 0:
        _norm_dim(dim, 0, "logcumsumexp")
        return input.clone()
    d = _norm_dim(dim, input.ndim, "logcumsumexp")
    y = input.movedim(d, -1)
    n, s = y.shape[-1], 1
    while s < n:
        y = cat([y[..., :s], logaddexp(y[..., s:], y[..., :n - s])], -1)
        s *= 2
    return y.movedim(-1, d) if s > 1 else y.movedim(-1, d).clone()
