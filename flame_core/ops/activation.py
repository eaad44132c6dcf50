"""Activations beyond the elementary functions: SiLU, GELU (erf and tanh forms), QuickGELU, softplus, hardshrink,
prelu.

SiLU, GELU and QuickGELU run on the fused kernels of flame_core.kernels.activations (one pass each way on cuda; their
NumPy reference elsewhere). GELU(tanh) of a strided view whose rows are contiguous (a column block of a wider matrix,
such as the MLP half of a fused projection) is read in place (kernels.gelu_rows): no copy of the block first. A
backward under create_graph uses the same derivative written with Tensor ops, so it can be differentiated again.
"""
import math

import numpy as np

from .. import backend
from ..autograd.engine import retaining_graph
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..kernels import activations as _K
from ..kernels import geglu as _geglu
from ..kernels import gelu_rows as _rows
from ..tensor import _wrap
from .elementwise import erf, exp, sigmoid, tanh, where
from .promotion import _float_arr

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_CUPY_FLAG_ATTR = backend.cupy is not None and hasattr(backend.cupy.ndarray, "_c_contiguous")


def _saved(x, a):
    """What backward needs of x: x itself, or its float copy `a` (integer inputs)."""
    return x if a is x._data else _wrap(a)


class Silu(Function):
    @staticmethod
    def forward(ctx, x):
        a = _float_arr(x, "silu")
        ctx.save_for_backward(_saved(x, a))
        return _wrap(_K.silu_forward(a))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if state.enabled:  # create_graph
            s = sigmoid(x)
            return g * (s * (1 + x * (1 - s)))
        return _wrap(_K.silu_backward(g._data, x._data))


class QuickGelu(Function):
    """x * sigmoid(1.702 x): OpenAI CLIP's GELU approximation (transformers' QuickGELUActivation), one kernel each
    way instead of a multiply, a sigmoid and a multiply."""

    @staticmethod
    def forward(ctx, x):
        a = _float_arr(x, "quick_gelu")
        ctx.save_for_backward(_saved(x, a))
        return _wrap(_K.quick_gelu_forward(a))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if state.enabled:  # create_graph
            s = sigmoid(x * _K.QGELU_K)
            return g * (s * (1 + x * _K.QGELU_K * (1 - s)))
        return _wrap(_K.quick_gelu_backward(g._data, x._data))


def _row_view(a):
    """`a` as a (rows, cols) view for the strided-rows kernel: a non-contiguous cuda array whose last axis has unit
    stride and whose leading axes collapse into one strided axis; None otherwise."""
    if type(a) is np.ndarray or a.ndim < 2 or a.strides[-1] != a.itemsize:
        return None
    if a._c_contiguous if _CUPY_FLAG_ATTR else a.flags.c_contiguous:  # CuPy's flag: `flags` builds an object per read
        return None
    rows, expect = 1, None
    for n, st in zip(reversed(a.shape[:-1]), reversed(a.strides[:-1])):
        if n == 1:
            continue
        if expect is not None and st != expect:
            return None
        expect, rows = st * n, rows * n
    return a.reshape(rows, a.shape[-1])


class GeluTanh(Function):
    @staticmethod
    def forward(ctx, x):
        a = _float_arr(x, "gelu")
        ctx.save_for_backward(_saved(x, a))
        rows = _row_view(a)
        if rows is not None:
            return _wrap(_rows.gelu_tanh_rows_forward(rows).reshape(a.shape))
        return _wrap(_K.gelu_forward(a, "tanh"))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if state.enabled:  # create_graph
            return g * _gelu_grad_ops(x, "tanh")
        # the MLP's widest gradient: written into the incoming one when nothing else holds it (one buffer of the
        # hidden width fewer at the backward's peak)
        own = ctx.grad_is_exclusive(g) and g._data.dtype == x._data.dtype and g.shape == x.shape
        rows = _row_view(x._data)
        if rows is not None:
            gd = g._data.reshape(rows.shape)
            return _wrap(_rows.gelu_tanh_rows_backward(gd, rows, out=gd if own else None).reshape(x.shape))
        return _wrap(_K.gelu_backward(g._data, x._data, "tanh", out=g._data if own else None))


class Gelu(Function):
    """GELU with the exact (erf) form."""

    @staticmethod
    def forward(ctx, x):
        a = _float_arr(x, "gelu")
        ctx.save_for_backward(_saved(x, a))
        return _wrap(_K.gelu_forward(a, "none"))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if state.enabled:  # create_graph
            return g * _gelu_grad_ops(x, "none")
        return _wrap(_K.gelu_backward(g._data, x._data, "none"))


def _gelu_grad_ops(x, approximate):
    """GELU'(x) with Tensor ops (differentiable again: the create_graph backwards)."""
    if approximate == "tanh":
        t = tanh((x + x * x * x * 0.044715) * _SQRT_2_OVER_PI)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * ((1 + x * x * (3 * 0.044715)) * _SQRT_2_OVER_PI)
    cdf = 0.5 * (1 + erf(x * (1 / math.sqrt(2))))
    return cdf + x * exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))


class Geglu(Function):
    """a * GELU(gate) of x = [a | gate] (last dimension): one kernel each way (kernels.geglu), saving only x."""

    @staticmethod
    def forward(ctx, x, approximate="none", temporary=False, gate_first=False):
        a = _float_arr(x, "geglu")
        ctx.approximate, ctx.gate_first = approximate, gate_first
        # a temporary input (nobody else holds it) whose memory backward may reuse for the gradient
        ctx.reuse = temporary and a is x._data and x._base is None and a.flags.c_contiguous
        ctx.save_for_backward(_saved(x, a))
        return _wrap(_geglu.geglu_forward(a, approximate, gate_first))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if state.enabled:  # create_graph: the same with Tensor ops
            from .shape import cat
            a, gate = x.chunk(2, dim=-1)
            if ctx.gate_first:
                a, gate = gate, a
            da, dgate = g * gelu(gate, ctx.approximate), g * a * _gelu_grad_ops(gate, ctx.approximate)
            return cat([dgate, da] if ctx.gate_first else [da, dgate], dim=-1), None, None, None
        reuse = ctx.reuse and not retaining_graph()   # x dies with this node: the gradient goes over it
        return (_wrap(_geglu.geglu_backward(g._data, x._data, ctx.approximate, inplace=reuse,
                                            gate_first=ctx.gate_first)), None, None, None)


def geglu(x, approximate="none", gate_first=False):
    """a * GELU(gate) where x = [a | gate] along the last dimension (diffusers' GEGLU after its projection);
    gate_first: x = [gate | a] (T5's gated feed-forward over its stacked [wi_0 | wi_1] projection)."""
    return _geglu_checked(x, approximate, False, gate_first)


def geglu_of_temporary(x, approximate="none"):
    """geglu(x) for an x that the caller creates for this call only and never reads again (a module's projection
    output): backward writes the gradient over x's memory instead of a second buffer of its size (unless the graph
    is retained). Reading x after backward gives the gradient, not x."""
    return _geglu_checked(x, approximate, True)


def _geglu_checked(x, approximate, temporary, gate_first=False):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.shape[-1] % 2:
        raise ValueError(f"geglu: the last dimension holds [a | gate] and must be even, got shape {tuple(x.shape)}")
    return Geglu.apply(x, approximate, temporary, bool(gate_first))


def silu(x):
    return Silu.apply(x)


def quick_gelu(x):
    """x * sigmoid(1.702 x) (OpenAI CLIP's activation)."""
    return QuickGelu.apply(x)


def gelu(x, approximate="none"):
    if approximate == "tanh":
        return GeluTanh.apply(x)
    if approximate == "none":
        return Gelu.apply(x)
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


class LogSigmoid(Function):
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)) (no overflow, no log(0)); gradient sigmoid(-x) (0.5 at 0)."""

    @staticmethod
    def forward(ctx, x):
        a = _float_arr(x)
        xp = backend.xp_of(a)
        af = a.astype(np.float32) if a.dtype.itemsize < 4 else a
        y = xp.minimum(af, 0) - xp.log1p(xp.exp(-xp.abs(af)))
        ctx.save_for_backward(x)
        return _wrap(y.astype(a.dtype))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * sigmoid(-x)


def logsigmoid(x):
    return LogSigmoid.apply(x)


def ones_grad(t):
    return _wrap(t._xp().ones(t._data.shape, dtype=t._data.dtype))


def softplus(x, beta=1.0, threshold=20.0):
    return Softplus.apply(x, beta, threshold)


def hardshrink(input, lambd=0.5):
    """x where |x| > lambd, else 0."""
    if lambd < 0:
        raise ValueError(f"hardshrink: lambd must be >= 0, got {lambd}")
    return where(input.abs() > lambd, input, 0.0)


def prelu(input, weight):
    """x where x > 0, else weight * x; weight has 1 element or one per channel (input's dimension 1)."""
    n = weight.numel()
    if n != 1:
        if input.ndim < 2 or input.shape[1] != n:
            raise ValueError(f"prelu: weight of {n} elements needs one per channel (dimension 1) of the input, "
                             f"got input {tuple(input.shape)}")
        weight = weight.reshape((1, n) + (1,) * (input.ndim - 2))
    return where(input > 0, input, weight * input)
