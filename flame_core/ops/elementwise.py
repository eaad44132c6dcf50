"""Elementwise ops. Each operator sits next to its derivative; backward rules use Tensor ops (double backward).
Small cuda arrays take cuda_src/pointwise_small.cu, first-order backward rules cuda_src/pointwise_grad.cu. How operands
meet (promotion, devices, broadcasting) is in promotion.py; in-place ops in inplace.py."""
import math

import numpy as np

from .. import backend
from .. import dtypes as D
from ..autograd.function import Function, broadcast_error
from ..autograd.grad_mode import state
from ..errors import DTypeError
from ..tensor import Tensor, _wrap
from .promotion import _F32_64, _cast, _cupy_ndarray, _default_float, _float_arr, _operands, _shape, no_fp8, sum_to

_np_ndarray = np.ndarray

# ----------------------------------------------------------------------------- small cuda arrays
_ps = None  # flame_core.kernels.pointwise_small, imported at first use


def _load_ps():
    global _ps
    from ..kernels import pointwise_small
    _ps = pointwise_small
    return pointwise_small


def _fast_arith(op, xa, xb):
    """xa OP xb (op: mul, add, sub) through cuda_src/pointwise_small.cu when the operands are a small contiguous cuda
    array and a Python scalar, or two such arrays of one shape and dtype; None otherwise (the caller's ufunc runs).
    The result has the array's dtype, as the ufunc's would (the callers' `_operands` already cast to it)."""
    ta = type(xa)
    if ta is _cupy_ndarray:
        tb = type(xb)
        if tb is _cupy_ndarray:
            return (_ps or _load_ps()).fast_binary(op, xa, xb)
        if tb is float or tb is int:
            return (_ps or _load_ps()).fast_scalar(op, xa, xb)
    elif type(xb) is _cupy_ndarray and (ta is float or ta is int):
        return (_ps or _load_ps()).fast_scalar("rsub" if op == "sub" else op, xb, xa)
    return None


# ----------------------------------------------------------------------------- binary arithmetic
class Add(Function):
    @staticmethod
    def forward(ctx, a, b, alpha=1):
        xa, xb, dt = _operands("add", a, b)
        ctx.shapes = (a._data.shape if isinstance(a, Tensor) else None,  # _shape, inlined
                      b._data.shape if isinstance(b, Tensor) else None)
        ctx.alpha = alpha
        if alpha == 1 and _cupy_ndarray is not None:
            r = _fast_arith("add", xa, xb)
            if r is not None:  # the array's dtype: dt (_operands cast to it)
                return _wrap(r if r.dtype is dt else _cast(r, dt))
        r = xa + xb if alpha == 1 else xa + xb * alpha
        return _wrap(r if type(r) is _np_ndarray and r.dtype is dt else _cast(r, dt))

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        gb = None
        needs = ctx.needs_input_grad
        if needs[1]:
            gb = g if ctx.alpha == 1 else g * ctx.alpha
            if gb._data.shape != sb:
                gb = sum_to(gb, sb)
        if not needs[0]:
            return None, gb, None
        return (g if g._data.shape == sa else sum_to(g, sa)), gb, None


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b, alpha=1):
        xa, xb, dt = _operands("sub", a, b)
        if dt == np.bool_:
            raise DTypeError("subtraction of bool tensors is not supported; use logical_xor or ~")
        ctx.shapes = (a._data.shape if isinstance(a, Tensor) else None,  # _shape, inlined
                      b._data.shape if isinstance(b, Tensor) else None)
        ctx.alpha = alpha
        if alpha == 1 and _cupy_ndarray is not None:
            r = _fast_arith("sub", xa, xb)
            if r is not None:
                return _wrap(r if r.dtype is dt else _cast(r, dt))
        r = xa - xb if alpha == 1 else xa - xb * alpha
        return _wrap(r if type(r) is _np_ndarray and r.dtype is dt else _cast(r, dt))

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        needs = ctx.needs_input_grad
        ga = gb = None
        if needs[0]:
            ga = g if g._data.shape == sa else sum_to(g, sa)
        if needs[1]:
            if ctx.alpha == 1:
                # another consumer's gradient already waits for b (a tensor subtracted in several places, a
                # residual): b's gradient is that minus g, written by the engine's slot in one kernel. Not when a
                # and b are one tensor (the engine adds ga first: the order of the two roundings stays)
                if (g._data.shape == sb and (not needs[0] or ctx.next_functions[0] != ctx.next_functions[1])
                        and ctx.sub_from_pending_grad(1, g)):
                    return ga, None, None
                gb = _grad_neg(g)
            else:
                gb = g * (-ctx.alpha)
            if gb._data.shape != sb:
                gb = sum_to(gb, sb)
        return ga, gb, None


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        xa, xb, dt = _operands("mul", a, b)
        needs = ctx.needs_input_grad
        if needs[0] or needs[1]:
            # each input's gradient needs the other operand only: a tensor is kept while the other input needs its
            # gradient (x * 2.0 keeps nothing of x, as torch's MulBackward1), a Python scalar as itself
            ta, tb = isinstance(a, Tensor), isinstance(b, Tensor)
            ctx.save_for_backward(a if ta and needs[1] else None, b if tb and needs[0] else None)
            ctx.scalars = (None if ta else a, None if tb else b)
            ctx.shapes = (a._data.shape if ta else None, b._data.shape if tb else None)
        if _cupy_ndarray is not None:
            r = _fast_arith("mul", xa, xb)
            if r is not None:
                return _wrap(r if r.dtype is dt else _cast(r, dt))
        r = xa * xb
        return _wrap(r if type(r) is _np_ndarray and r.dtype is dt else _cast(r, dt))

    @staticmethod
    def backward(ctx, g):
        needs = ctx.needs_input_grad
        sa, sb = ctx.scalars
        s = sb if sa is None else sa  # the Python scalar operand (None for two tensors)
        if s is not None and not state.enabled and type(g._data) is _cupy_ndarray and ctx.grad_is_exclusive(g):
            # tensor * scalar with a gradient nothing else holds: g * scalar written into g (small cuda arrays)
            gd = g._data
            if (_ps or _load_ps()).fast_scalar("mul", gd, s, gd) is not None:
                return (g, None) if sa is None else (None, g)
        a, b = ctx.saved_tensors
        sha, shb = ctx.shapes
        ga = gb = None
        if needs[0]:
            ga = _grad_mul(g, b if b is not None else sb)
            if ga._data.shape != sha:
                ga = sum_to(ga, sha)
        if needs[1]:
            gb = _grad_mul(g, a if a is not None else sa)
            if gb._data.shape != shb:
                gb = sum_to(gb, shb)
        return ga, gb


def _grad_mul(g, other):
    """`g * other` inside a first-order backward rule: straight on the arrays when nothing is recorded and no dtype
    promotion is involved (the same ufunc the Mul op would run, without its bookkeeping), else the Tensor op."""
    if not state.enabled:
        gd = g._data
        if type(gd) is _cupy_ndarray:  # small cuda arrays: cuda_src/pointwise_small.cu (the same rounding as the ufunc)
            to = type(other)
            if to is float or to is int:
                r = (_ps or _load_ps()).fast_scalar("mul", gd, other)
            elif isinstance(other, Tensor):
                r = (_ps or _load_ps()).fast_binary("mul", gd, other._data)
            else:
                r = None
            if r is not None:
                return _wrap(r)
        dt = gd.dtype
        if dt in _F32_64:
            to = type(other)
            if to is float or to is int:
                return _wrap(gd * other)
            if isinstance(other, Tensor):
                od = other._data
                if od.dtype is dt and type(od) is type(gd):
                    return _wrap(gd * od)
    return g * other


def _grad_neg(g):
    """`-g` inside a first-order backward rule (see _grad_mul)."""
    if not state.enabled and type(g._data) is _cupy_ndarray:
        r = (_ps or _load_ps()).fast_unary("neg", g._data)
        if r is not None:
            return _wrap(r)
    if not state.enabled and g._data.dtype in _F32_64:
        return _wrap(-g._data)
    return -g


class Div(Function):
    @staticmethod
    def forward(ctx, a, b, rounding_mode=None):
        xa, xb, dt = _operands("div", a, b)
        if rounding_mode is None:
            if dt.kind in "biu":
                dt = _default_float().np
                xa = xa.astype(dt) if isinstance(a, Tensor) else xa
                xb = xb.astype(dt) if isinstance(b, Tensor) else xb
            out = xa / xb
        elif rounding_mode == "floor":
            xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
            out = xp.floor_divide(xa, xb)
        elif rounding_mode == "trunc":
            xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
            out = xp.trunc(xa / xb) if dt.kind == "f" or dt == D.bfloat16.np else \
                (xp.sign(xa) * xp.sign(xb) * (xp.abs(xa) // xp.abs(xb)))
        else:
            raise ValueError(f"div: rounding_mode must be None, 'floor' or 'trunc', got {rounding_mode!r}")
        ctx.rounding = rounding_mode
        ctx.save_for_backward(a if isinstance(a, Tensor) else None, b if isinstance(b, Tensor) else None)
        ctx.scalars = (a, b)
        return _wrap(_cast(out, dt))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.rounding is not None:  # piecewise constant
            return (None if a is None else zeros_grad(a), None if b is None else zeros_grad(b), None)
        sa, sb = ctx.scalars
        bb = b if b is not None else sb
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = sum_to(g / bb, a.shape)
        if ctx.needs_input_grad[1]:
            aa = a if a is not None else sa
            gb = sum_to(-g * aa / (b * b), b.shape)
        return ga, gb, None


def zeros_grad(t):
    return _wrap(t._xp().zeros(t._data.shape, dtype=t._data.dtype))


def _modulo(name, ufunc, rounding, doc):
    """A modulo Function: y = a - b * round(a / b) (rounding "floor": remainder, "trunc": fmod); its gradients are
    g for a and -g * round(a / b) for b, as PyTorch's."""

    def forward(ctx, a, b):
        xa, xb, dt = _operands(name, a, b)
        xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
        ctx.save_for_backward(a if isinstance(a, Tensor) else None, b if isinstance(b, Tensor) else None)
        ctx.scalars = (a, b)
        return _wrap(_cast(_ufunc(name, getattr(xp, ufunc), a, b, xa, xb), dt))

    def backward(ctx, g):
        a, b = ctx.saved_tensors
        sa, sb = ctx.scalars
        ga = sum_to(g, a.shape) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            aa = a if a is not None else sa
            gb = sum_to(-g * div(aa, b, rounding_mode=rounding), b.shape)
        return ga, gb

    return type(name.capitalize(), (Function,), {"__doc__": doc, "forward": staticmethod(forward),
                                                 "backward": staticmethod(backward)})


Remainder = _modulo("remainder", "remainder", "floor", "Python-style modulo (sign of the divisor), as torch.remainder.")
Fmod = _modulo("fmod", "fmod", "trunc", "C-style modulo (sign of the dividend), as torch.fmod.")


class Pow(Function):
    @staticmethod
    def forward(ctx, a, b):
        xa, xb, dt = _operands("pow", a, b)
        xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
        if isinstance(a, Tensor) and dt.kind in "iu" and isinstance(b, Tensor):
            out = xp.power(xa, xb)
        else:
            out = xp.power(xa, xb)
        y = _wrap(_cast(out, dt))
        ctx.save_for_backward(a if isinstance(a, Tensor) else None, b if isinstance(b, Tensor) else None, y)
        ctx.scalars = (a, b)
        return y

    @staticmethod
    def backward(ctx, g):
        a, b, y = ctx.saved_tensors
        sa, sb = ctx.scalars
        ga = gb = None
        if ctx.needs_input_grad[0]:
            if b is None:
                ga = g * sb * a ** (sb - 1) if sb != 0 else zeros_grad(a)
            else:
                ga = sum_to(g * b * a ** (b - 1), a.shape)
        if ctx.needs_input_grad[1]:
            base = a if a is not None else sa
            logb = log(base) if isinstance(base, Tensor) else math.log(base) if base > 0 else float("nan")
            gb = sum_to(g * y * logb, b.shape)
        return ga, gb


class Maximum(Function):
    @staticmethod
    def forward(ctx, a, b):
        xa, xb, dt = _operands("maximum", a, b)
        ctx.save_for_backward(a, b)
        return _wrap(_cast(backend.xp_of(xa).maximum(xa, xb), dt))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _minmax_grads(ctx, g, gt(a, b), lt(a, b), eq(a, b), a, b)


class Minimum(Function):
    @staticmethod
    def forward(ctx, a, b):
        xa, xb, dt = _operands("minimum", a, b)
        ctx.save_for_backward(a, b)
        return _wrap(_cast(backend.xp_of(xa).minimum(xa, xb), dt))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _minmax_grads(ctx, g, lt(a, b), gt(a, b), eq(a, b), a, b)


def _minmax_grads(ctx, g, a_wins, b_wins, tie, a, b):
    # ties split the gradient in half, as PyTorch does
    wa = a_wins.to(g.dtype) + tie.to(g.dtype) * 0.5
    wb = b_wins.to(g.dtype) + tie.to(g.dtype) * 0.5
    return (sum_to(g * wa, a.shape) if ctx.needs_input_grad[0] else None,
            sum_to(g * wb, b.shape) if ctx.needs_input_grad[1] else None)


def add(a, b, *, alpha=1):
    return Add.apply(a, b, alpha) if isinstance(a, Tensor) or isinstance(b, Tensor) else a + alpha * b


def sub(a, b, *, alpha=1):
    return Sub.apply(a, b, alpha)


def mul(a, b):
    return Mul.apply(a, b)


def div(a, b, *, rounding_mode=None):
    return Div.apply(a, b, rounding_mode)


def true_divide(a, b):
    return Div.apply(a, b, None)


def floor_divide(a, b):
    return Div.apply(a, b, "floor")


def remainder(a, b):
    return Remainder.apply(a, b)


def pow(a, b):
    return Pow.apply(a, b)


def maximum(a, b):
    return Maximum.apply(a, b)


def minimum(a, b):
    return Minimum.apply(a, b)


def fmod(a, b):
    return Fmod.apply(a, b)


def _ufunc(op, fn, a, b, xa, xb):
    """fn(xa, xb) for the ops that are not Functions; a broadcast failure names the shapes (ShapeError)."""
    try:
        return fn(xa, xb)
    except ValueError as e:
        if "broadcast" not in str(e):
            raise
        raise broadcast_error(op, (a, b), e) from e


# ----------------------------------------------------------------------------- unary
def _pointwise_grad(kernel, g, s, into=False):
    """One fused launch of cuda_src/pointwise_grad.cu, or None when the arrays don't qualify. Small contiguous arrays
    take the same rule from cuda_src/pointwise_small.cu (a packed launch: a fraction of the host cost); with `into`
    (a backward that holds its gradient alone) they write the result into g. Larger arrays get a new buffer, as
    before 1bb46bd: the one GPU run that wrote them in place too (5996fe8) failed auto_fit's activation-offload test
    (tests/offload/test_gpu_activation_offload.py), which passed before it; the cause was not isolated."""
    r = (_ps or _load_ps()).fast_grad(kernel, g, s, g if into else None)
    if r is not None:
        return _wrap(r)
    loader, launching = _kernel_modules or _load_kernel_modules()
    dt = g.dtype
    if not (loader.use_kernel(g, s) and (s.dtype is dt or s.dtype == dt) and g.shape == s.shape):
        return None
    if _CUPY_FLAG_ATTR:  # CuPy's own flag (ndarray.flags builds a Python object per read)
        if not (g._c_contiguous and s._c_contiguous):
            return None
    elif not (g.flags.c_contiguous and s.flags.c_contiguous):
        return None
    out = backend.cupy.empty(g.shape, dt)
    n = g.size
    if n:
        launching.launch(loader.get_function("pointwise_grad", kernel, dt), (min((n + 255) // 256, 8192),), (256,),
                         (g, s, out, np.int64(n)))
    return _wrap(out)


_kernel_modules = None  # (flame_core.kernels.loader, .launching), imported at first use
_CUPY_FLAG_ATTR = backend.cupy is not None and hasattr(backend.cupy.ndarray, "_c_contiguous")


def _load_kernel_modules():
    global _kernel_modules
    from ..kernels import launching, loader
    _kernel_modules = (loader, launching)
    return _kernel_modules


def _unary(name, compute, grad, saves="x", differentiable=True, fused=None, plain=False):
    """Define an elementwise Function: y = compute(xp, x_array); dx = grad(g, x, y) with Tensor ops.

    `fused` names a kernel of cuda_src/pointwise_grad.cu used for the first-order backward on cuda (the composed
    Tensor-op rule stays the path for double backward and for the cpu). `plain`: `grad` uses only arithmetic
    operators, so a first-order backward in float32/float64 runs it on the arrays themselves (the same ufuncs in the
    same order as the Tensor ops, without an op's bookkeeping per operator)."""

    save_x, save_y = "x" in saves, "y" in saves

    def forward(ctx, x):
        a = x._data
        if a.dtype not in _F32_64 or x._f8:  # _float_arr's checks, skipped for float32/float64
            a = _float_arr(x)
        y = _wrap(compute(np if type(a) is _np_ndarray else backend.xp_of(a), a))
        if differentiable:
            xs = None
            if save_x:
                xs = x if a is x._data else _wrap(a)
            ctx.save_for_backward(xs, y if save_y else None)
        return y

    def backward(ctx, g):
        if state.enabled:  # double backward: the rule's Tensor ops are recorded
            x, y = ctx.saved_tensors
            return grad(g, x, y)
        x, y = ctx.saved_values()
        if fused is not None and type(g._data) is not np.ndarray:
            into = ctx.grad_is_exclusive(g)  # (before a name holds g's array) the rule may write into g
            gd = g._data
            if backend.is_cuda_array(gd):
                r = _pointwise_grad(fused, gd, (y if save_y else x)._data, into)
                if r is not None:
                    return r
        gd = g._data
        if plain and gd.dtype in _F32_64:
            xd = x._data if x is not None else None
            yd = y._data if y is not None else None
            s = yd if save_y else xd
            if s is None or (s.dtype is gd.dtype and type(s) is type(gd)):
                return _wrap(grad(gd, xd, yd))
        return grad(g, x, y)

    return type(name, (Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _erf_arr(xp, a):
    if xp is not np:
        from cupyx.scipy.special import erf as _cerf
        return _cerf(a.astype(np.float32) if a.dtype.itemsize < 4 else a).astype(a.dtype)
    return _np_erf(a.astype(np.float64)).astype(a.dtype)


_erf_ufunc = np.frompyfunc(math.erf, 1, 1)


def _np_erf(a):
    """Exact erf on NumPy (math.erf per element): the cpu path and the oracle."""
    return np.asarray(_erf_ufunc(a), dtype=np.float64)


def _in_f32(fn):
    """Evaluate a transcendental in at least float32 (half types) and cast back."""
    def run(xp, a):
        if a.dtype.itemsize < 4:
            return fn(xp, a.astype(np.float32)).astype(a.dtype)
        return fn(xp, a)
    return run


def _neg_arr(xp, a):
    if xp is not np:
        r = (_ps or _load_ps()).fast_unary("neg", a)  # small cuda arrays: cuda_src/pointwise_small.cu
        if r is not None:
            return r
    return -a


_tanh_ref = _in_f32(lambda xp, a: xp.tanh(a))


def _tanh_arr(xp, a):
    if xp is np:
        return np.tanh(a) if a.dtype.itemsize >= 4 else _tanh_ref(np, a)
    r = (_ps or _load_ps()).fast_unary("tanh", a)  # small cuda arrays: tanhf in fp32, as _in_f32 computes
    return r if r is not None else _tanh_ref(xp, a)


Neg = _unary("Neg", _neg_arr, lambda g, x, y: -g, saves="", plain=True)
Exp = _unary("Exp", _in_f32(lambda xp, a: xp.exp(a)), lambda g, x, y: g * y, saves="y", plain=True)
Log = _unary("Log", _in_f32(lambda xp, a: xp.log(a)), lambda g, x, y: g / x, plain=True)
Log1p = _unary("Log1p", _in_f32(lambda xp, a: xp.log1p(a)), lambda g, x, y: g / (x + 1), plain=True)
Sqrt = _unary("Sqrt", _in_f32(lambda xp, a: xp.sqrt(a)), lambda g, x, y: g * 0.5 / y, saves="y", fused="sqrt_bwd",
               plain=True)
Rsqrt = _unary("Rsqrt", _in_f32(lambda xp, a: 1 / xp.sqrt(a)), lambda g, x, y: g * (-0.5) * y * y * y, saves="y",
               fused="rsqrt_bwd", plain=True)
Sin = _unary("Sin", _in_f32(lambda xp, a: xp.sin(a)), lambda g, x, y: g * cos(x))
Cos = _unary("Cos", _in_f32(lambda xp, a: xp.cos(a)), lambda g, x, y: -g * sin(x))
Tanh = _unary("Tanh", _tanh_arr, lambda g, x, y: g * (1 - y * y), saves="y",
              fused="tanh_bwd", plain=True)
Sigmoid = _unary("Sigmoid", _in_f32(lambda xp, a: 0.5 * (xp.tanh(a * 0.5) + 1)), lambda g, x, y: g * y * (1 - y),
                 saves="y", fused="sigmoid_bwd", plain=True)
Relu = _unary("Relu", lambda xp, a: xp.maximum(a, 0).astype(a.dtype), lambda g, x, y: g * (y > 0).to(g.dtype),
              saves="y", fused="relu_bwd")
Abs = _unary("Abs", lambda xp, a: xp.abs(a), lambda g, x, y: g * sign(x), fused="abs_bwd")
Sign = _unary("Sign", lambda xp, a: xp.where(xp.isnan(a), 0, xp.sign(a)).astype(a.dtype, copy=False),
              lambda g, x, y: g * 0, saves="")   # sign(NaN) = 0, as PyTorch's
Floor = _unary("Floor", lambda xp, a: xp.floor(a), lambda g, x, y: g * 0, saves="")
Ceil = _unary("Ceil", lambda xp, a: xp.ceil(a), lambda g, x, y: g * 0, saves="")
Round = _unary("Round", lambda xp, a: xp.round(a), lambda g, x, y: g * 0, saves="")
Trunc = _unary("Trunc", lambda xp, a: xp.trunc(a), lambda g, x, y: g * 0, saves="")
Erf = _unary("Erf", _erf_arr, lambda g, x, y: g * (2 / math.sqrt(math.pi)) * exp(-x * x))
Reciprocal = _unary("Reciprocal", lambda xp, a: 1 / a, lambda g, x, y: -g * y * y, saves="y", plain=True)
Square = _unary("Square", lambda xp, a: a * a, lambda g, x, y: g * 2 * x, plain=True)


def _integral(x, op):
    """x's array, x holding integers (PyTorch keeps their dtype: no float conversion, nothing to record); a bool
    tensor is refused as PyTorch refuses it."""
    a = x._data
    if a.dtype.kind == "b":
        raise TypeError(f"{op}: not supported on a bool tensor" + (" (to invert a mask use ~ or logical_not())"
                                                                   if op == "neg" else ""))
    return a


def neg(x):
    if x._data.dtype.kind not in "iub" or x._f8:   # (float8 bytes are uint8 on cuda)
        return Neg.apply(x)
    return _wrap(-_integral(x, "neg"))


def exp(x):
    return Exp.apply(x)


def log(x):
    return Log.apply(x)


def log1p(x):
    return Log1p.apply(x)


def sqrt(x):
    return Sqrt.apply(x)


def rsqrt(x):
    return Rsqrt.apply(x)


def sin(x):
    return Sin.apply(x)


def cos(x):
    return Cos.apply(x)


def tanh(x):
    return Tanh.apply(x)


def sigmoid(x):
    return Sigmoid.apply(x)


def relu(x):
    return Relu.apply(x)


def abs(x):
    if x._data.dtype.kind not in "iub" or x._f8:
        return Abs.apply(x)
    return _wrap(x._xp().abs(_integral(x, "abs")))


def sign(x):
    if x.dtype.is_floating_point:
        return Sign.apply(x)
    return x.clone() if x._data.dtype == np.bool_ else _wrap(x._xp().sign(x._data))   # bool: itself, as PyTorch


def floor(x):
    return Floor.apply(x) if x.dtype.is_floating_point else x.clone()


def ceil(x):
    return Ceil.apply(x) if x.dtype.is_floating_point else x.clone()


def round(x, decimals=0):
    if decimals:
        return Round.apply(x * 10 ** decimals) / 10 ** decimals
    return Round.apply(x) if x.dtype.is_floating_point else x.clone()


def trunc(x):
    return Trunc.apply(x) if x.dtype.is_floating_point else x.clone()


def erf(x):
    return Erf.apply(x)


def reciprocal(x):
    return Reciprocal.apply(x)


def square(x):
    a = x._data
    if a.dtype.kind in "iub" and not x._f8:   # integers stay integers; bool squares to int64 (as PyTorch)
        return _wrap(a * a if a.dtype.kind != "b" else a.astype(np.int64))
    return Square.apply(x)


class Clamp(Function):
    @staticmethod
    def forward(ctx, x, min=None, max=None):
        no_fp8("clamp", x)
        a = x._data
        xp = backend.xp_of(a)
        lo = min._data if isinstance(min, Tensor) else min
        hi = max._data if isinstance(max, Tensor) else max
        ctx.save_for_backward(x)
        ctx.bounds = (min, max)
        if type(a) is _cupy_ndarray:   # small cuda arrays, Python bounds: one packed launch (pointwise_small.cu)
            r = (_ps or _load_ps()).fast_clamp(a, lo, hi)
            if r is not None:
                return _wrap(r)
        y = a
        if lo is not None:
            y = xp.maximum(y, lo)
        if hi is not None:
            y = xp.minimum(y, hi)
        return _wrap(_cast(y, a.dtype if not isinstance(lo, float) and not isinstance(hi, float)
                           else D.result_type(x, lo if lo is not None else hi).np))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        lo, hi = ctx.bounds
        if not state.enabled and type(g._data) is _cupy_ndarray:
            r = (_ps or _load_ps()).fast_clamp_grad(g._data, x._data, lo, hi)
            if r is not None:
                return _wrap(r), None, None
        mask = None
        if lo is not None:
            mask = ge(x, lo)
        if hi is not None:
            m2 = le(x, hi)
            mask = m2 if mask is None else logical_and(mask, m2)
        return g * mask.to(g.dtype), None, None


def clamp(x, min=None, max=None):
    if min is None and max is None:
        raise ValueError("clamp: at least one of min or max must be given")
    return Clamp.apply(x, min, max)


clip = clamp


def clamp_min(x, min):
    return Clamp.apply(x, min, None)


def clamp_max(x, max):
    return Clamp.apply(x, None, max)


class Where(Function):
    @staticmethod
    def forward(ctx, cond, a, b):
        xa, xb, dt = _operands("where", a, b)
        c = cond._data
        xp = backend.xp_of(c)
        if c.dtype != np.bool_:
            c = c.astype(np.bool_)
        ctx.save_for_backward(cond)
        ctx.shapes = (_shape(a), _shape(b))
        return _wrap(_cast(xp.where(c, xa, xb), dt))

    @staticmethod
    def backward(ctx, g):
        (cond,) = ctx.saved_tensors
        sa, sb = ctx.shapes
        z = zeros_grad(g)
        ga = sum_to(where(cond, g, z), sa) if ctx.needs_input_grad[1] else None
        gb = sum_to(where(cond, z, g), sb) if ctx.needs_input_grad[2] else None
        return None, ga, gb


def where(condition, input=None, other=None):
    if input is None and other is None:
        from .indexing import nonzero
        return nonzero(condition, as_tuple=True)
    return Where.apply(condition, input, other)


def lerp(start, end, weight):
    """start + weight * (end - start) (differentiable in all three)."""
    return start + weight * (end - start)


# ----------------------------------------------------------------------------- comparisons and logic (no grad)
def _cmp(op, ufunc_name):
    def f(a, b):
        xa, xb, _ = _operands(op, a, b)
        xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
        return _wrap(_ufunc(op, getattr(xp, ufunc_name), a, b, xa, xb))
    f.__name__ = op
    return f


eq = _cmp("eq", "equal")
ne = _cmp("ne", "not_equal")
lt = _cmp("lt", "less")
le = _cmp("le", "less_equal")
gt = _cmp("gt", "greater")
ge = _cmp("ge", "greater_equal")
logical_and = _cmp("logical_and", "logical_and")
logical_or = _cmp("logical_or", "logical_or")
logical_xor = _cmp("logical_xor", "logical_xor")


def _is_bool(v):
    return isinstance(v, bool) or (isinstance(v, Tensor) and v._data.dtype == np.bool_)


def _bitwise(op, logical):
    """The & | ^ operators (PyTorch's bitwise ops): on bool operands the logical op itself (the same values and
    kernels as before, which masks -- and CUDA-graph-captured code -- use), on integers the bitwise ufunc."""
    bitwise = _cmp(op, op)

    def f(a, b):
        return logical(a, b) if _is_bool(a) and _is_bool(b) else bitwise(a, b)
    f.__name__ = op
    return f


bitwise_and = _bitwise("bitwise_and", logical_and)
bitwise_or = _bitwise("bitwise_or", logical_or)
bitwise_xor = _bitwise("bitwise_xor", logical_xor)


def logical_not(x):
    return _wrap(x._xp().logical_not(x._data))


def bitwise_not(x):
    xp = x._xp()
    return _wrap(xp.logical_not(x._data) if x._data.dtype == np.bool_ else xp.invert(x._data))


def isnan(x):
    return _wrap(x._xp().isnan(x._data.astype(np.float32) if x._data.dtype.itemsize < 4 else x._data))


def isinf(x):
    return _wrap(x._xp().isinf(x._data.astype(np.float32) if x._data.dtype.itemsize < 4 else x._data))


def isfinite(x):
    return _wrap(x._xp().isfinite(x._data.astype(np.float32) if x._data.dtype.itemsize < 4 else x._data))


def isclose(a, b, rtol=1e-5, atol=1e-8, equal_nan=False):
    """|a - b| <= atol + rtol * |b| elementwise (equal infinities are close; NaNs only with equal_nan), broadcast."""
    xa = a._data.astype(np.float64) if isinstance(a, Tensor) else a
    xb = b._data.astype(np.float64) if isinstance(b, Tensor) else b
    xp = backend.xp_of(xa if isinstance(a, Tensor) else xb)
    return _wrap(xp.isclose(xa, xb, rtol=rtol, atol=atol, equal_nan=equal_nan))


def allclose(a, b, rtol=1e-5, atol=1e-8, equal_nan=False):
    xa, xb = a._data.astype(np.float64), b._data.astype(np.float64)
    return bool(backend.xp_of(xa).allclose(xa, xb, rtol=rtol, atol=atol, equal_nan=equal_nan))


def equal(a, b):
    return tuple(a.shape) == tuple(b.shape) and bool(eq(a, b).all())
