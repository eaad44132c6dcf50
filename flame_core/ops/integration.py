"""The trapezoidal rule along a dim, PyTorch's trapezoid / trapz and cumulative_trapezoid: sample spacing from `x`
(1-D, or broadcasting with y) or a constant `dx` (1 by default). Differentiable in y and x."""
from ..errors import ShapeError, fmt_shape
from ..tensor import Tensor
from .shape import _norm_dim


def _terms(op, y, x, dx, dim):
    if x is not None and dx is not None:
        raise TypeError(f"{op}: give x or dx, not both")
    d = _norm_dim(dim, y.ndim, op)
    n = y.shape[d]
    ys = y.narrow(d, 1, n - 1) + y.narrow(d, 0, n - 1) if n else y
    if x is None:
        return ys * ((1.0 if dx is None else dx) / 2), d
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if x.ndim == 1:
        if x.shape[0] != n:
            raise ShapeError(f"{op}: x has {x.shape[0]} samples but y has {n} along dim {d} (y of shape "
                             f"{fmt_shape(y.shape)})")
        spacing = x.diff().reshape((-1,) + (1,) * (y.ndim - 1 - d)) if n else x
    else:
        xd = _norm_dim(dim, x.ndim, op)
        spacing = x.diff(dim=xd) if n else x
    return ys * spacing / 2, d


def trapezoid(y, x=None, *, dx=None, dim=-1):
    """The integral of y along dim by the trapezoidal rule: sum((x[i+1] - x[i]) * (y[i+1] + y[i]) / 2)."""
    t, d = _terms("trapezoid", y, x, dx, dim)
    return t.sum(d) if y.shape[d] else y.sum(d) * 0


def trapz(y, x=None, *, dx=None, dim=-1):
    return trapezoid(y, x, dx=dx, dim=dim)


def cumulative_trapezoid(y, x=None, *, dx=None, dim=-1):
    """The running trapezoidal integral along dim: one element fewer than y there."""
    t, d = _terms("cumulative_trapezoid", y, x, dx, dim)
    return t.cumsum(d) if y.shape[d] else t
