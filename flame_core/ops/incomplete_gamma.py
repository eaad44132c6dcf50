"""The regularized incomplete gamma functions, PyTorch's special.gammainc P(a, x) (torch.igamma) and gammaincc
Q(a, x) = 1 - P (torch.igammac). On cuda CuPy's; elsewhere in float64: P's series sum_n x^n / (a (a+1) ... (a+n))
where x < a + 1, Q's continued fraction (modified Lentz) elsewhere, each times x^a e^-x / Gamma(a) (relative error
~1e-15, ~1e-13 for a in the hundreds, whose prefactor's exponent is large). PyTorch's edges: NaN for a < 0 or x < 0
or a = x = 0; P = 1 for a = 0 < x and for x = inf; P = 0 at x = 0. Differentiable in x (x^(a-1) e^-x / Gamma(a),
0 for a <= 0); the derivative in a is not implemented, as PyTorch's."""
import math

import numpy as np

from ..errors import AutogradError
from ..tensor import Tensor
from . import elementwise as E
from .math_ops import _binary

_EPS, _TINY, _MAX_ITER = 1e-16, 1e-300, 100000


def _lgamma(a):
    return np.vectorize(math.lgamma, otypes=[np.float64])(a) if a.size else a


def _p_and_q(a, x):
    """(P, Q) of float64 arrays of one shape, the interior a > 0, 0 < x < inf only."""
    log_pre = a * np.log(x) - x - _lgamma(a)
    series = x < a + 1
    p, q = np.empty_like(x), np.empty_like(x)
    s_a, s_x = a[series], x[series]
    if s_a.size:
        ap, term = s_a.copy(), 1.0 / s_a
        total = term.copy()
        for _ in range(_MAX_ITER):
            ap += 1
            term = term * s_x / ap
            total += term
            if np.all(np.abs(term) < np.abs(total) * _EPS):
                break
        p[series] = total * np.exp(log_pre[series])
        q[series] = 1 - p[series]
    c_a, c_x = a[~series], x[~series]
    if c_a.size:
        b = c_x + 1 - c_a
        c = np.full_like(b, 1 / _TINY)
        d = 1 / b
        h = d.copy()
        for i in range(1, _MAX_ITER):
            an = -i * (i - c_a)
            b = b + 2
            d = an * d + b
            d = np.where(np.abs(d) < _TINY, _TINY, d)
            c = b + an / c
            c = np.where(np.abs(c) < _TINY, _TINY, c)
            d = 1 / d
            delta = d * c
            h = h * delta
            if np.all(np.abs(delta - 1) < _EPS):
                break
        q[~series] = np.exp(log_pre[~series]) * h
        p[~series] = 1 - q[~series]
    return p, q


def _compute(upper):
    def compute(xp, a, x):
        if xp is not np:
            from cupyx.scipy import special as S
            return (S.gammaincc if upper else S.gammainc)(a, x)
        a, x = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(x, np.float64))
        out = np.full(a.shape, np.nan)
        inside = (a > 0) & (x > 0) & np.isfinite(x)
        if inside.any():
            p, q = _p_and_q(a[inside], x[inside])
            out[inside] = q if upper else p
        one = ((a == 0) & (x > 0)) | ((a > 0) & (x == np.inf))      # P = 1
        zero = (a > 0) & (x == 0)                                    # P = 0
        out[one], out[zero] = (0.0 if upper else 1.0), (1.0 if upper else 0.0)
        return out
    return compute


def _grads(sign):
    def grads(g, a, x, y, na, nx):
        if na:
            raise AutogradError("the derivative of the incomplete gamma function in its first argument (a) is not "
                                "implemented (as PyTorch's)")
        if not nx:
            return None, None
        if isinstance(a, Tensor):
            from .special_fns import lgamma
            density = E.exp(E.log(x) * (a - 1) - x - lgamma(a))
            return None, E.where(a <= 0, 0.0, g * density * sign)
        if a <= 0:
            return None, g * 0
        return None, g * E.exp(E.log(x) * (a - 1) - x - math.lgamma(a)) * sign
    return grads


Gammainc = _binary("Gammainc", _compute(False), _grads(1.0))
Gammaincc = _binary("Gammaincc", _compute(True), _grads(-1.0))


def gammainc(input, other):
    """P(a = input, x = other): the regularized lower incomplete gamma function."""
    return Gammainc.apply(input, other)


def gammaincc(input, other):
    """Q(a = input, x = other) = 1 - P: the regularized upper incomplete gamma function."""
    return Gammaincc.apply(input, other)
