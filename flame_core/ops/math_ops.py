"""PyTorch's elementwise math beyond the core set: the inverse and hyperbolic trigonometric functions, tan, expm1,
exp2, log2, log10, erfc, erfinv, logit, sinc, nan_to_num, frac, deg2rad / rad2deg, sgn / signbit / positive; the
two-operand atan2, hypot, xlogy, logaddexp, copysign, fmax, fmin, float_power, heaviside; addcmul / addcdiv.

Each differentiable one has PyTorch's derivative (as Tensor ops, so double backward works), including its choices at
the edges: logit's eps zeroes the gradient outside [eps, 1 - eps], nan_to_num passes it only where the input is
finite, xlogy's x = 0 gives 0 for both the value and the x gradient, sinc's gradient is 0 at 0, fmax / fmin give the
whole gradient to the operand chosen (the other when one is NaN), copysign's gradient is sign(result / x) (0 at
x = 0). Half-precision inputs are evaluated in float32 and rounded once; integer inputs give the default float dtype,
as PyTorch's float functions do."""
import collections
import math
import statistics

import ml_dtypes
import numpy as np

from .. import backend
from .. import dtypes as D
from ..autograd.function import Function
from ..kernels import erfc_fit
from ..tensor import Tensor, _wrap
from . import elementwise as E
from .promotion import _FLOAT_NP, _default_float, _float_arr, _operands, sum_to

_in_f32 = E._in_f32
_LN2, _LN10 = math.log(2.0), math.log(10.0)
_SQRT_PI_2 = math.sqrt(math.pi) / 2
_TWO_SQRT_PI = 2 / math.sqrt(math.pi)


# ----------------------------------------------------------------------------- one operand
def _erfinv_scalar(v):
    """erfinv of one float: -sign(v) * Phi^-1((1 - |v|) / 2) / sqrt(2) (1 - |v| is exact near 1, where (1 + v) / 2
    would round), +-inf at +-1, NaN outside [-1, 1]."""
    if v != v or abs(v) > 1:
        return math.nan
    if abs(v) == 1:
        return math.copysign(math.inf, v)
    if v == 0:
        return v
    return -math.copysign(1.0, v) * statistics.NormalDist().inv_cdf((1 - abs(v)) / 2) / math.sqrt(2)


_erfinv_ufunc = np.frompyfunc(_erfinv_scalar, 1, 1)


def _erfinv_arr(xp, a):
    if xp is not np:
        from cupyx.scipy.special import erfinv as _cerfinv
        return _cerfinv(a.astype(np.float32) if a.dtype.itemsize < 4 else a).astype(a.dtype)
    return np.asarray(_erfinv_ufunc(a.astype(np.float64)), dtype=np.float64).astype(a.dtype)


def _erfc_arr(xp, a):
    if xp is not np:
        from cupyx.scipy.special import erfc as _cerfc
        return _cerfc(a.astype(np.float32) if a.dtype.itemsize < 4 else a).astype(a.dtype)
    if a.dtype != np.float64:   # float32 and below: the fitted erfc (2.6e-10 relative), one array pass per step
        return erfc_fit.erfc(a.astype(np.float64)).astype(a.dtype)
    return np.asarray(np.frompyfunc(math.erfc, 1, 1)(a), dtype=np.float64)


def _sinc_arr(xp, a):
    pa = a * math.pi
    safe = xp.where(a == 0, 1, pa)
    return xp.where(a == 0, 1, xp.sin(safe) / safe).astype(a.dtype)


def _sinc_grad(g, x, y):
    # (cos(pi x) - sinc(x)) / x, 0 at x = 0
    zero = x == 0
    safe = E.where(zero, 1.0, x)
    return g * E.where(zero, 0.0, (E.cos(safe * math.pi) - y) / safe)


Tan = E._unary("Tan", _in_f32(lambda xp, a: xp.tan(a)), lambda g, x, y: g * (y * y + 1), saves="y")
Asin = E._unary("Asin", _in_f32(lambda xp, a: xp.arcsin(a)), lambda g, x, y: g / E.sqrt(1 - x * x))
Acos = E._unary("Acos", _in_f32(lambda xp, a: xp.arccos(a)), lambda g, x, y: -g / E.sqrt(1 - x * x))
Atan = E._unary("Atan", _in_f32(lambda xp, a: xp.arctan(a)), lambda g, x, y: g / (x * x + 1))
Sinh = E._unary("Sinh", _in_f32(lambda xp, a: xp.sinh(a)), lambda g, x, y: g * cosh(x))
Cosh = E._unary("Cosh", _in_f32(lambda xp, a: xp.cosh(a)), lambda g, x, y: g * sinh(x))
Asinh = E._unary("Asinh", _in_f32(lambda xp, a: xp.arcsinh(a)), lambda g, x, y: g / E.sqrt(x * x + 1))
Acosh = E._unary("Acosh", _in_f32(lambda xp, a: xp.arccosh(a)), lambda g, x, y: g / E.sqrt(x * x - 1))
Atanh = E._unary("Atanh", _in_f32(lambda xp, a: xp.arctanh(a)), lambda g, x, y: g / (1 - x * x))
Expm1 = E._unary("Expm1", _in_f32(lambda xp, a: xp.expm1(a)), lambda g, x, y: g * (y + 1), saves="y")
Exp2 = E._unary("Exp2", _in_f32(lambda xp, a: xp.exp2(a)), lambda g, x, y: g * y * _LN2, saves="y")
Log2 = E._unary("Log2", _in_f32(lambda xp, a: xp.log2(a)), lambda g, x, y: g / (x * _LN2))
Log10 = E._unary("Log10", _in_f32(lambda xp, a: xp.log10(a)), lambda g, x, y: g / (x * _LN10))
Erfc = E._unary("Erfc", _erfc_arr, lambda g, x, y: -g * _TWO_SQRT_PI * E.exp(-x * x))
Erfinv = E._unary("Erfinv", _erfinv_arr, lambda g, x, y: g * _SQRT_PI_2 * E.exp(y * y), saves="y")
Sinc = E._unary("Sinc", _in_f32(_sinc_arr), _sinc_grad, saves="xy")


def tan(x):
    return Tan.apply(x)


def asin(x):
    return Asin.apply(x)


def acos(x):
    return Acos.apply(x)


def atan(x):
    return Atan.apply(x)


def sinh(x):
    return Sinh.apply(x)


def cosh(x):
    return Cosh.apply(x)


def asinh(x):
    return Asinh.apply(x)


def acosh(x):
    return Acosh.apply(x)


def atanh(x):
    return Atanh.apply(x)


def expm1(x):
    return Expm1.apply(x)


def exp2(x):
    return Exp2.apply(x)


def log2(x):
    return Log2.apply(x)


def log10(x):
    return Log10.apply(x)


def erfc(x):
    return Erfc.apply(x)


def erfinv(x):
    return Erfinv.apply(x)


def sinc(x):
    return Sinc.apply(x)


class Logit(Function):
    @staticmethod
    def forward(ctx, x, eps):
        a = _float_arr(x, "logit")
        xp = backend.xp_of(a)
        wide = a.astype(np.float32) if a.dtype.itemsize < 4 else a
        z = xp.clip(wide, eps, 1 - eps) if eps is not None else wide
        ctx.save_for_backward(x)
        ctx.eps = eps
        return _wrap((xp.log(z) - xp.log1p(-z)).astype(a.dtype))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        d = g / (x * (1 - x))
        if ctx.eps is not None:   # PyTorch: no gradient where the input was clamped
            d = E.where((x < ctx.eps) | (x > 1 - ctx.eps), 0.0, d)
        return d, None


def logit(x, eps=None):
    """log(x / (1 - x)); with eps the input is clamped to [eps, 1 - eps] first (no gradient outside it)."""
    return Logit.apply(x, None if eps is None else float(eps))


class NanToNum(Function):
    @staticmethod
    def forward(ctx, x, nan, posinf, neginf):
        a = x._data
        ctx.save_for_backward(x)
        if a.dtype not in _FLOAT_NP:   # integers and booleans hold no NaN or infinity
            return _wrap(a.copy())
        xp = backend.xp_of(a)
        info = ml_dtypes.finfo(a.dtype)
        hi = float(info.max) if posinf is None else posinf
        lo = float(info.min) if neginf is None else neginf
        w = a.astype(np.float32) if a.dtype.itemsize < 4 else a
        y = xp.where(xp.isnan(w), nan, xp.where(w == np.inf, hi, xp.where(w == -np.inf, lo, w)))
        return _wrap(y.astype(a.dtype))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * E.isfinite(x).to(g.dtype), None, None, None


def nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    """NaN -> nan, +inf -> posinf, -inf -> neginf (default: the dtype's largest / lowest finite values)."""
    return NanToNum.apply(x, float(nan), None if posinf is None else float(posinf),
                          None if neginf is None else float(neginf))


def frac(x):
    """x - trunc(x) (the sign of x kept)."""
    return x - E.trunc(x)


def deg2rad(x):
    return x * (math.pi / 180)


def rad2deg(x):
    return x * (180 / math.pi)


def sgn(x):
    """sign(x) for real tensors (PyTorch's sgn extends sign to complex numbers)."""
    return E.sign(x)


def signbit(x):
    """Whether the sign bit is set (True for -0.0 and negative values; NaN's own sign bit)."""
    a = x._data
    return _wrap(backend.xp_of(a).signbit(a.astype(np.float32) if a.dtype == D.bfloat16.np else a))


def positive(x):
    return x


# ----------------------------------------------------------------------------- two operands
def _binary(name, compute, grads, floating=True):
    """A two-operand elementwise Function (tensors or Python scalars, PyTorch's promotion; `floating`: integer
    results give the default float dtype): y = compute(xp, a, b) on the arrays (half types in float32, rounded once);
    grads(g, a, b, y, need_a, need_b) -> (da, db) as Tensor ops on the broadcast shape, summed back here."""

    def forward(ctx, a, b):
        xa, xb, dt = _operands(name, a, b)
        if floating and dt.kind in "biu":
            dt = _default_float().np
            xa = xa.astype(dt) if isinstance(a, Tensor) else xa
            xb = xb.astype(dt) if isinstance(b, Tensor) else xb
        xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
        if dt.itemsize < 4 and dt.kind != "b":
            wa = xa.astype(np.float32) if isinstance(a, Tensor) else xa
            wb = xb.astype(np.float32) if isinstance(b, Tensor) else xb
            y = compute(xp, wa, wb)
        else:
            y = compute(xp, xa, xb)
        y = _wrap(xp.asarray(y).astype(dt, copy=False))
        ctx.save_for_backward(a if isinstance(a, Tensor) else None, b if isinstance(b, Tensor) else None, y)
        ctx.scalars = (None if isinstance(a, Tensor) else a, None if isinstance(b, Tensor) else b)
        return y

    def backward(ctx, g):
        a, b, y = ctx.saved_tensors
        na, nb = ctx.needs_input_grad
        ua = a if a is not None else ctx.scalars[0]
        ub = b if b is not None else ctx.scalars[1]
        da, db = grads(g, ua, ub, y, na and a is not None, nb and b is not None)
        return (sum_to(da, a.shape) if da is not None else None,
                sum_to(db, b.shape) if db is not None else None)

    return type(name, (Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _atan2_grads(g, a, b, y, na, nb):
    r = a * a + b * b
    return (g * b / r if na else None), (-g * a / r if nb else None)


def _hypot_grads(g, a, b, y, na, nb):
    return (g * a / y if na else None), (g * b / y if nb else None)


def _xlogy_compute(xp, a, b):
    with np.errstate(divide="ignore", invalid="ignore"):   # log(0) and 0 * -inf: replaced by the where
        logb = np.log(np.float64(b)) if isinstance(b, (int, float)) else xp.log(b)
        if isinstance(a, (int, float)):
            return a * logb if a != 0 else xp.zeros_like(logb)
        return xp.where(a == 0, 0, a * logb)


def _xlogy_grads(g, a, b, y, na, nb):
    return _xlog_grads(g, a, b, na, nb, E.log, math.log, 0.0)


def _xlog_grads(g, a, b, na, nb, log_t, log_s, pole):
    """xlogy's (pole 0, log) and xlog1py's (pole -1, log1p) gradients as PyTorch's: d/da = xlogy(g, log(b)) -- g
    times the log, 0 where g is 0 -- zeroed where a is 0 and b <= pole; d/db = g a / (b - pole)."""
    da = db = None
    if na:
        if isinstance(b, Tensor):
            zero = E.logical_or(E.eq(g, 0), E.logical_and(E.eq(a, 0), E.le(b, pole)))
            da = E.where(zero, 0.0, g * log_t(b))
        else:
            logb = log_s(b) if b > pole else (-math.inf if b == pole else math.nan)
            zero = E.logical_or(E.eq(g, 0), E.eq(a, 0)) if b <= pole else E.eq(g, 0)
            da = E.where(zero, 0.0, g * logb)
    if nb:
        db = g * a / (b - pole) if pole else g * a / b
    return da, db


def _logaddexp_grads(g, a, b, y, na, nb):
    return (g * E.exp(a - y) if na else None), (g * E.exp(b - y) if nb else None)


def _copysign_grads(g, a, b, y, na, nb):
    da = None
    if na:   # PyTorch's copysign_tensor_self_backward: grad * result / self, 0 where self is 0
        safe = E.where(E.eq(a, 0), 1.0, a)
        da = g * E.where(E.eq(a, 0), 0.0, y / safe)
    return da, (g * 0 if nb else None)   # the sign's source gets zeros, as in PyTorch


def _fmaxmin_grads(cmp):
    def grads(g, a, b, y, na, nb):
        # a gets the gradient where it was chosen: a >= b (fmax) / a <= b (fmin), or b is NaN (both NaN: a)
        if isinstance(b, Tensor):
            a_wins = E.logical_or(cmp(a, b), E.isnan(b))
        elif b != b:   # a Python NaN: a is chosen everywhere
            a_wins = E.logical_not(cmp(a, b))
        else:
            a_wins = cmp(a, b)
        a_wins = a_wins.to(g.dtype)
        return (g * a_wins if na else None), (g * (1 - a_wins) if nb else None)
    return grads


Atan2 = _binary("Atan2", lambda xp, a, b: xp.arctan2(a, b), _atan2_grads)
Hypot = _binary("Hypot", lambda xp, a, b: xp.hypot(a, b), _hypot_grads)
Xlogy = _binary("Xlogy", _xlogy_compute, _xlogy_grads)
Logaddexp = _binary("Logaddexp", lambda xp, a, b: xp.logaddexp(a, b), _logaddexp_grads)
Copysign = _binary("Copysign", lambda xp, a, b: xp.copysign(a, b), _copysign_grads)
Fmax = _binary("Fmax", lambda xp, a, b: xp.fmax(a, b), _fmaxmin_grads(E.ge), floating=False)
Fmin = _binary("Fmin", lambda xp, a, b: xp.fmin(a, b), _fmaxmin_grads(E.le), floating=False)


def atan2(input, other):
    """The angle of (other, input) in (-pi, pi]: arctan2(input, other), as torch.atan2."""
    return Atan2.apply(input, other)


arctan2 = atan2


def hypot(input, other):
    return Hypot.apply(input, other)


def xlogy(input, other):
    """input * log(other), 0 where input is 0 (whatever other is)."""
    return Xlogy.apply(input, other)


def logaddexp(input, other):
    """log(exp(input) + exp(other)) without overflow."""
    return Logaddexp.apply(input, other)


def copysign(input, other):
    return Copysign.apply(input, other)


def fmax(input, other):
    """maximum that ignores a NaN operand (NaN only where both are)."""
    return Fmax.apply(input, other)


def fmin(input, other):
    return Fmin.apply(input, other)


def float_power(input, exponent):
    """input ** exponent in float64 (PyTorch's float_power; the result is float64)."""
    a = input.double() if isinstance(input, Tensor) else float(input)
    b = exponent.double() if isinstance(exponent, Tensor) else float(exponent)
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise TypeError("float_power: one of input and exponent must be a tensor")
    return E.pow(a, b)


def heaviside(input, values):
    """0 where input < 0, values where input == 0, 1 where input > 0 (not differentiable, as in PyTorch)."""
    if input.requires_grad or (isinstance(values, Tensor) and values.requires_grad):
        raise RuntimeError("heaviside is not differentiable with respect to its inputs (as in PyTorch)")
    xa, xb, dt = _operands("heaviside", input, values)
    xp = backend.xp_of(xa)
    return _wrap(xp.heaviside(xa, xb).astype(dt, copy=False))


def addcmul(input, tensor1, tensor2, *, value=1):
    """input + value * tensor1 * tensor2 (the optimizers' second-moment update)."""
    return input + value * (tensor1 * tensor2) if value != 1 else input + tensor1 * tensor2


def addcdiv(input, tensor1, tensor2, *, value=1):
    """input + value * tensor1 / tensor2 (the optimizers' parameter update)."""
    if isinstance(tensor1, Tensor) and isinstance(tensor2, Tensor) and not (
            tensor1.dtype.is_floating_point or tensor2.dtype.is_floating_point):
        raise RuntimeError("addcdiv: integer division with addcdiv is not supported (as in PyTorch); use "
                           "true_divide(tensor1, tensor2) instead")
    return input + value * (tensor1 / tensor2) if value != 1 else input + tensor1 / tensor2


def logaddexp2(input, other):
    """log2(2 ** input + 2 ** other) without overflow."""
    return Logaddexp.apply(input * _LN2, other * _LN2) / _LN2


def ldexp(input, other):
    """input * 2 ** other (a float result; differentiable in input and other)."""
    dt = D.promote_types(input.dtype, other.dtype)
    dt = dt if dt.is_floating_point else D.get_default_dtype()   # 2 ** other in the result's dtype (float64 exact)
    return E.mul(input.to(dt), E.pow(2.0, other.to(dt)))


frexp_result = collections.namedtuple("frexp", ["mantissa", "exponent"])


def frexp(input):
    """(mantissa, exponent) with input = mantissa * 2 ** exponent, |mantissa| in [0.5, 1) (0 for 0); exponent int32.
    The mantissa is differentiable: input's gradient is the mantissa's divided by 2 ** exponent."""
    if not input.dtype.is_floating_point:
        raise TypeError(f"frexp: expected a floating point tensor, got {input.dtype.name}")
    xp = backend.xp_of(input._data)
    a = input._data.astype(np.float32) if input._data.dtype.itemsize < 4 else input._data
    _, e = xp.frexp(a)
    exponent = _wrap(e.astype(np.int32))
    return frexp_result(E.mul(input, _wrap(xp.ldexp(xp.ones_like(a), -e).astype(input._data.dtype))), exponent)


def nextafter(input, other):
    """The next representable value after input towards other, in input's dtype (not differentiable)."""
    xa, xb, dt = _operands("nextafter", input, other)
    if dt not in _FLOAT_NP:
        raise TypeError(f"nextafter: expected floating point operands, got {D.dtype_of(dt).name}")
    xp = backend.xp_of(xa if isinstance(input, Tensor) else xb)
    return _wrap(xp.asarray(xp.nextafter(xa, xb)).astype(dt, copy=False))



Angle = E._unary("Angle", lambda xp, a: xp.where(a < 0, a.dtype.type(math.pi), xp.where(a != a, a, 0)).astype(a.dtype),
                 lambda g, x, y: g * 0, saves="")


def angle(input):
    """The argument of each (real) element: pi where it is negative, 0 elsewhere, NaN kept; a float result, with a
    zero gradient (PyTorch's for real input)."""
    return Angle.apply(input)
