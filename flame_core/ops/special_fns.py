"""The gamma family and the normal distribution's functions: lgamma, digamma, polygamma, mvlgamma, the Hurwitz zeta
function, ndtr, ndtri, log_ndtr, xlog1py, entr (torch.special's names are in flame_core.special).

Values (float64 here; half types in float32 and rounded once; integer inputs give the default float dtype):
- lgamma: log |Gamma(x)| (math.lgamma on the CPU, CuPy's gammaln on cuda); +inf at 0 and the negative integers.
- digamma: x < 0 by the reflection psi(x) = psi(1 - x) - pi / tan(pi x); x > 0 shifted up to >= 10 by psi(x) =
  psi(x + 1) - 1 / x, then the asymptotic series to x^-14 (error < 1e-16 relative there); -inf at 0 (PyTorch's choice
  since 1.8; +inf at -0), NaN at the negative integers and -inf.
- zeta(s, q) = sum over k >= 0 of (q + k)^-s: the terms until q + k > 9, then the Euler-Maclaurin tail with twelve
  Bernoulli corrections (the Cephes scheme PyTorch uses); +inf at s = 1, NaN for s < 1; for q <= 0: +inf at
  integers, NaN unless s is an integer.
- polygamma(n, x) = (-1)^(n + 1) n! zeta(n + 1, x) for n >= 1, digamma for n = 0.
Each derivative is PyTorch's: lgamma' = digamma, digamma' = polygamma(1, .), polygamma(n, .)' = polygamma(n + 1, .)
(as Tensor ops, so higher derivatives work); zeta's in q is -x zeta(x + 1, q) (none in x, as PyTorch), ndtri' =
sqrt(2 pi) exp(ndtri(p)^2 / 2), log_ndtr' = exp(-x^2 / 2 - log_ndtr(x)) / sqrt(2 pi)."""
import math

import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import Tensor, _wrap
from . import elementwise as E
from .math_ops import _binary, _xlog_grads
from .promotion import _float_arr

_LOG_PI = math.log(math.pi)
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# the Euler-Maclaurin corrections' denominators (2k)! / B_2k of the Hurwitz zeta tail (Cephes' zeta.c)
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)


def _wide(a):
    return a.astype(np.float32) if a.dtype.itemsize < 4 else a


def _lgamma_scalar(v):
    try:
        return math.lgamma(v)
    except (ValueError, OverflowError):   # the poles (0 and the negative integers)
        return math.inf


_lgamma_ufunc = np.frompyfunc(_lgamma_scalar, 1, 1)


def _lgamma_arr(xp, a):
    w = _wide(a)
    if xp is not np:
        from cupyx.scipy.special import gammaln
        return xp.where(w == -np.inf, np.inf, gammaln(w)).astype(a.dtype)   # (CuPy's gives -inf there; +inf)
    return np.asarray(_lgamma_ufunc(w.astype(np.float64)), dtype=np.float64).astype(a.dtype)


def _digamma_positive(xp, x):
    """psi(x) for x > 0 (float32 / float64 arrays)."""
    acc = xp.zeros_like(x)
    x = x.copy()
    for _ in range(10):   # shift up to x >= 10: psi(x) = psi(x + 1) - 1 / x
        low = x < 10
        if not bool(low.any()):
            break
        acc -= xp.where(low, 1 / xp.where(low, x, 1), 0)
        x = xp.where(low, x + 1, x)
    r = 1 / (x * x)
    series = r * (1 / 12 - r * (1 / 120 - r * (1 / 252 - r * (1 / 240 - r * (1 / 132 - r * (691 / 32760
                                                                                           - r / 12))))))
    return acc + xp.log(x) - 0.5 / x - series


def _digamma_arr(xp, a):
    with np.errstate(divide="ignore", invalid="ignore"):   # the poles: set by the wheres
        return _digamma_reflected(xp, a)


def _digamma_reflected(xp, a):
    x = _wide(a)
    neg = x < 0
    xr = xp.where(neg, 1 - x, x)   # reflection: psi(x) = psi(1 - x) - pi / tan(pi x)
    pos = xr > 0
    y = _digamma_positive(xp, xp.where(pos, xr, 1))
    if bool(neg.any()):
        frac = x - xp.floor(x)
        y = xp.where(neg, y - math.pi / xp.tan(math.pi * xp.where(frac == 0, 0.5, x)), y)
        y = xp.where(neg & (frac == 0), np.nan, y)
    y = xp.where(x == 0, xp.copysign(np.inf, -x), y)   # -inf at +0, +inf at -0 (PyTorch's)
    y = xp.where(xp.isnan(x) | (x == -np.inf), np.nan, xp.where(x == np.inf, np.inf, y))
    return y.astype(a.dtype)


def _zeta_arr(xp, s, q):
    """The Hurwitz zeta function of broadcast float arrays s, q (float64 or float32)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # the poles: set by the wheres at the end
        return _zeta_series(xp, s, q)


def _zeta_series(xp, s, q):
    s, q = xp.broadcast_arrays(s, q)
    s, q = s.astype(q.dtype) if s.dtype != q.dtype else s, q
    total = q ** -s
    a = q.copy()
    b = xp.zeros_like(q)
    k = 0
    while True:   # the terms while a <= 9 (at least nine): every element to a > 9
        need = (a <= 9) | (k < 9)
        if not bool(need.any()):
            break
        a = xp.where(need, a + 1, a)
        b = xp.where(need, a ** -s, b)
        total = xp.where(need, total + b, total)
        k += 1
    w = a
    total = total + b * w / (s - 1) - 0.5 * b
    fa, kk = xp.ones_like(q), 0.0
    for den in _ZETA_A:
        fa = fa * (s + kk)
        b = b / w
        total = total + fa * b / den
        kk += 1
        fa = fa * (s + kk)
        b = b / w
        kk += 1
    total = xp.where(s == 1, np.inf, xp.where(s < 1, np.nan, total))
    qint = q == xp.floor(q)
    total = xp.where((q <= 0) & qint, np.inf, total)
    total = xp.where((q <= 0) & ~qint & (s != xp.floor(s)), np.nan, total)
    return total


def _polygamma_arr(xp, n, a):
    if n == 0:
        return _digamma_arr(xp, a)
    x = _wide(a)
    z = _zeta_arr(xp, xp.full_like(x, n + 1), x)
    return ((-1) ** (n + 1) * math.factorial(n) * z).astype(a.dtype)


Lgamma = E._unary("Lgamma", _lgamma_arr, lambda g, x, y: g * digamma(x))
Digamma = E._unary("Digamma", _digamma_arr, lambda g, x, y: g * polygamma(1, x))


class Polygamma(Function):
    @staticmethod
    def forward(ctx, x, n):
        a = _float_arr(x, "polygamma")
        ctx.save_for_backward(x)
        ctx.n = n
        return _wrap(_polygamma_arr(backend.xp_of(a), n, a))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * polygamma(ctx.n + 1, x), None


def lgamma(x):
    """log |Gamma(x)|."""
    return Lgamma.apply(x)


def digamma(x):
    """d/dx lgamma(x) (psi)."""
    return Digamma.apply(x)


def polygamma(n, x):
    """The n-th derivative of digamma (n >= 0, an int)."""
    if isinstance(n, Tensor) or not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"polygamma: n must be a non-negative int, got {n!r}")
    if n == 0:
        return digamma(x)
    return Polygamma.apply(x, int(n))


def mvlgamma(x, p):
    """The multivariate log-gamma of dimension p: sum over i < p of lgamma(x - i / 2) + p (p - 1) / 4 log(pi); as
    PyTorch, every element must be > (p - 1) / 2."""
    if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 1:
        raise ValueError(f"mvlgamma: p must be a positive int, got {p!r}")
    a = x._data
    if a.size and not bool((a > (p - 1) / 2).all()):
        raise ValueError(f"mvlgamma: all elements must be greater than (p - 1) / 2 = {(p - 1) / 2}")
    xp_ = backend.xp_of(a)
    offsets = _wrap(xp_.arange(p, dtype=_float_arr(x, "mvlgamma").dtype) * -0.5)
    return lgamma(x.unsqueeze(-1) + offsets).sum(-1) + p * (p - 1) / 4 * _LOG_PI


class Zeta(Function):
    @staticmethod
    def forward(ctx, x, other):
        from .promotion import _default_float, _operands
        xa, qa, dt = _operands("zeta", x, other)
        xp = backend.xp_of(qa if isinstance(other, Tensor) else xa)
        dt = np.dtype(dt) if np.dtype(dt).kind == "f" else _default_float().np
        xa, qa = xp.asarray(xa, dtype=dt), xp.asarray(qa, dtype=dt)
        ctx.save_for_backward(x if isinstance(x, Tensor) else None, other if isinstance(other, Tensor) else None)
        ctx.x = None if isinstance(x, Tensor) else x
        return _wrap(_zeta_arr(xp, _wide(xa), _wide(qa)).astype(dt))

    @staticmethod
    def backward(ctx, g):
        from .promotion import sum_to
        x, q = ctx.saved_tensors
        nx, nq = ctx.needs_input_grad
        if nx and x is not None:
            raise NotImplementedError("zeta: the derivative with respect to its first argument (x) is not "
                                      "implemented (as in PyTorch); detach x")
        if not (nq and q is not None):
            return None, None
        s = x if x is not None else ctx.x
        return None, sum_to(g * -s * zeta(s + 1, q), q.shape)


def zeta(x, other):
    """The Hurwitz zeta function sum over k >= 0 of (other + k)^-x (torch.special.zeta; either may be a Python
    number). Differentiable in `other` (d/dq = -x zeta(x + 1, q)), not in x (as PyTorch's)."""
    if not isinstance(x, Tensor) and not isinstance(other, Tensor):
        raise TypeError("zeta: expected at least one tensor operand")
    return Zeta.apply(x, other)


def ndtr(x):
    """The standard normal distribution's CDF, (1 + erf(x / sqrt(2))) / 2."""
    from .math_ops import erfc
    return erfc(x * (-1 / _SQRT2)) * 0.5


def ndtri(p):
    """The inverse of ndtr: sqrt(2) erfinv(2 p - 1)."""
    from .math_ops import erfinv
    return erfinv(p * 2 - 1) * _SQRT2


def _log_ndtr_arr(xp, a):
    x = _wide(a)
    from .math_ops import _erfc_arr
    with np.errstate(divide="ignore", invalid="ignore"):
        # x > 0: log1p(-ndtr(-x)) (log(ndtr(x)) would round ndtr(x) to 1 first); -20 <= x <= 0: log(erfc(-x/sqrt 2)/2)
        right = xp.log1p(_erfc_arr(xp, xp.maximum(x, 0) / _SQRT2) * -0.5)
        mid = xp.log(_erfc_arr(xp, -xp.clip(x, -20.0, 0.0) / _SQRT2) * 0.5)
        # x < -20: log(phi(x) / -x) + log(1 - 1/x^2 + 3/x^4 - 15/x^6 + 105/x^8 - 945/x^10) (the tail's asymptotic
        # series; the next term is below 1e-12 there)
        t = xp.minimum(x, -20.0)
        r = 1 / (t * t)
        tail = -0.5 * t * t - math.log(math.sqrt(2 * math.pi)) - xp.log(-t) + xp.log1p(
            -r * (1 - r * (3 - r * (15 - r * (105 - r * 945)))))
    return xp.where(x > 0, right, xp.where(x < -20, tail, mid)).astype(a.dtype)


LogNdtr = E._unary("LogNdtr", _log_ndtr_arr, lambda g, x, y: g * E.exp(x * x * -0.5 - y) * _INV_SQRT_2PI,
                   saves="xy")


def log_ndtr(x):
    """log(ndtr(x)), accurate far in the left tail."""
    return LogNdtr.apply(x)


def _xlog1py_compute(xp, a, b):
    with np.errstate(divide="ignore", invalid="ignore"):   # log1p(-1) and 0 * -inf: replaced by the where
        l1b = np.log1p(np.float64(b)) if isinstance(b, (int, float)) else xp.log1p(b)
        if isinstance(a, (int, float)):
            return a * l1b if a != 0 else xp.zeros_like(l1b)
        return xp.where(a == 0, 0, a * l1b)


def _xlog1py_grads(g, a, b, y, na, nb):
    return _xlog_grads(g, a, b, na, nb, E.log1p, math.log1p, -1.0)


Xlog1py = _binary("Xlog1py", _xlog1py_compute, _xlog1py_grads)


def xlog1py(input, other):
    """input * log1p(other), 0 where input is 0 (whatever other is): torch.special.xlog1py."""
    return Xlog1py.apply(input, other)


def _entr_arr(xp, a):
    x = _wide(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = xp.where(x > 0, -x * xp.log(xp.where(x > 0, x, 1)), xp.where(x == 0, 0.0, -np.inf))
    return xp.where(xp.isnan(x), np.nan, y).astype(a.dtype)


# PyTorch's derivative, -(1 + log x) everywhere: +inf at 0, NaN for x < 0
Entr = E._unary("Entr", _entr_arr, lambda g, x, y: g * -(E.log(x) + 1))


def entr(x):
    """-x log x for x > 0, 0 at 0, -inf for x < 0 (the elementwise entropy)."""
    return Entr.apply(x)
