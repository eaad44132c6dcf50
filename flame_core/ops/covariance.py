"""torch.cov and torch.corrcoef: the (weighted) covariance / correlation matrix of the rows of a 2-D tensor
(variables in rows, observations in columns; a 1-D tensor is one variable). Differentiable in the input."""
import warnings

from .. import dtypes as D
from ..errors import DTypeError, ShapeError, fmt_shape
from ..tensor import Tensor
from . import elementwise as E


def _weights(name, w, n, integral):
    if w is None:
        return None
    if not isinstance(w, Tensor):
        raise TypeError(f"cov: {name} must be a Tensor, got {type(w).__name__}")
    if w.ndim > 1 or w.numel() != n:
        raise ShapeError(f"cov: {name} must be 1-D with as many elements as observations ({n}), got shape "
                         f"{fmt_shape(w.shape)}")
    if integral and w.dtype.is_floating_point:
        raise DTypeError(f"cov: fweights must be integral, got {w.dtype.name}")
    if not integral and not w.dtype.is_floating_point:
        raise DTypeError(f"cov: aweights must be floating point, got {w.dtype.name}")
    if n and bool((w < 0).any()):
        raise ValueError(f"cov: {name} cannot be negative")
    return w


def cov(input, *, correction=1, fweights=None, aweights=None):
    """Covariance of the variables in input's rows: sum of w (x - avg)(y - avg) / (sum w - correction * ...), numpy's
    and PyTorch's normalisation with frequency weights `fweights` and observation weights `aweights`."""
    if input.ndim > 2:
        raise ShapeError(f"cov: expected a 1-D or 2-D input, got shape {fmt_shape(input.shape)}")
    x = input.reshape(1, -1) if input.ndim < 2 else input
    if not x.dtype.is_floating_point:
        x = x.to(D.get_default_dtype())
    n = x.shape[1]
    fw = _weights("fweights", fweights, n, True)
    aw = _weights("aweights", aweights, n, False)
    w = fw.to(x.dtype) if fw is not None else None
    if aw is not None:
        w = aw.to(x.dtype) if w is None else w * aw.to(x.dtype)
    if w is None:
        w_sum = float(n)
        avg = x.mean(1, keepdim=True)
        factor = w_sum - correction
    else:
        w_sum = w.sum()
        avg = (x * w).sum(1, keepdim=True) / w_sum
        if correction == 0:
            factor = w_sum
        elif aw is None:
            factor = w_sum - correction
        else:
            factor = w_sum - correction * (w * aw.to(x.dtype)).sum() / w_sum
    if float(factor) <= 0:
        warnings.warn("cov(): degrees of freedom is <= 0; correction should be strictly less than the number of "
                      "observations (the result is inf / nan, as PyTorch's)", stacklevel=2)
        factor = E.clamp(factor, min=0) if isinstance(factor, Tensor) else 0.0
    xm = x - avg
    c = ((xm if w is None else xm * w) @ xm.transpose(0, 1)) / factor
    return c.reshape(()) if input.ndim < 2 or x.shape[0] == 1 else c


def corrcoef(input):
    """Pearson correlation coefficients of the variables in input's rows, clipped to [-1, 1]."""
    c = cov(input)
    if c.ndim == 0:
        return c / c
    d = c.diagonal().sqrt()
    return E.clamp(c / d.unsqueeze(1) / d.unsqueeze(0), -1, 1)
