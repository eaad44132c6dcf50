"""Activations beyond the elementary functions: SiLU, GELU (erf and tanh forms), softplus."""
import math

import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import _wrap
from .elementwise import _erf_arr, _in_f32, _unary, erf, exp, sigmoid, tanh, where
from .promotion import _float_arr


def _silu_arr(xp, a):
    return a * (0.5 * (xp.tanh(a * 0.5) + 1))


def _silu_grad(g, x, y):
    s = sigmoid(x)
    return g * (s * (1 + x * (1 - s)))


Silu = _unary("Silu", _in_f32(_silu_arr), _silu_grad)

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def _gelu_tanh_arr(xp, a):
    return 0.5 * a * (1 + xp.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)))


def _gelu_tanh_grad(g, x, y):
    inner = (x + x * x * x * 0.044715) * _SQRT_2_OVER_PI
    t = tanh(inner)
    dinner = (1 + x * x * (3 * 0.044715)) * _SQRT_2_OVER_PI
    return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dinner)


def _gelu_erf_arr(xp, a):
    return 0.5 * a * (1 + _erf_arr(xp, a / math.sqrt(2)))


def _gelu_erf_grad(g, x, y):
    cdf = 0.5 * (1 + erf(x * (1 / math.sqrt(2))))
    pdf = exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return g * (cdf + x * pdf)


GeluTanh = _unary("GeluTanh", _in_f32(_gelu_tanh_arr), _gelu_tanh_grad)
GeluErf = _unary("Gelu", _in_f32(_gelu_erf_arr), _gelu_erf_grad)


def silu(x):
    return Silu.apply(x)


def gelu(x, approximate="none"):
    if approximate == "tanh":
        return GeluTanh.apply(x)
    if approximate == "none":
        return GeluErf.apply(x)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


class Softplus(Function):
    @staticmethod
    def forward(ctx, x, beta=1.0, threshold=20.0):
        a = _float_arr(x)
        xp = backend.xp_of(a)
        af = a.astype(np.float32) if a.dtype.itemsize < 4 else a
        z = af * beta
        y = xp.where(z > threshold, af, xp.log1p(xp.exp(xp.minimum(z, threshold))) / beta)
        ctx.save_for_backward(x)
        ctx.beta, ctx.threshold = beta, threshold
        return _wrap(y.astype(a.dtype))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        z = x * ctx.beta
        s = sigmoid(z)
        return g * where(z > ctx.threshold, ones_grad(s), s), None, None


def ones_grad(t):
    return _wrap(t._xp().ones(t._data.shape, dtype=t._data.dtype))


def softplus(x, beta=1.0, threshold=20.0):
    return Softplus.apply(x, beta, threshold)
