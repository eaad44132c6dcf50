"""Activations and softmax (PyTorch names); the elementwise ops themselves live in flame_core. The activations
without a kernel of their own are compositions of differentiable Tensor ops (so they also have double backward)."""
from flame_core.autograd import is_grad_enabled, no_grad
from flame_core.errors import DTypeError
from flame_core.ops import activation as A
from flame_core.ops import creation as C
from flame_core.ops import elementwise as E
from flame_core.ops import reduction as R


def relu(input, inplace=False):
    return input.relu_() if inplace else E.relu(input)


def relu_(input):
    return input.relu_()


def gelu(input, approximate="none"):
    return A.gelu(input, approximate=approximate)


def geglu(input, approximate="none", gate_first=False):
    """a * gelu(gate) where input = [a | gate] along the last dimension (diffusers' GEGLU after its projection);
    gate_first: input = [gate | a] (T5's gelu(wi_0 x) * wi_1 x over the stacked [wi_0 | wi_1] projection). One fused
    kernel each way, keeping only the input for backward."""
    return A.geglu(input, approximate=approximate, gate_first=gate_first)


def silu(input, inplace=False):
    return input.silu_() if inplace else A.silu(input)


def quick_gelu(input):
    """input * sigmoid(1.702 input): OpenAI CLIP's activation (transformers' QuickGELUActivation; a FLAME name, torch
    has none), one fused kernel each way."""
    return A.quick_gelu(input)


def tanh(input):
    return E.tanh(input)


def sigmoid(input):
    return E.sigmoid(input)


def softmax(input, dim=-1, dtype=None):
    return R.softmax(input, dim, dtype=dtype)


def log_softmax(input, dim=-1, dtype=None):
    return R.log_softmax(input, dim, dtype=dtype)


def _inplace(fn, input):
    """inplace=True: fn(input) written into `input`. When autograd records, fn runs on a copy of the input, so the
    tensors its backward saved are not the ones overwritten (PyTorch keeps the original value the same way)."""
    src = input.clone() if (is_grad_enabled() and input.requires_grad) else input
    return input.copy_(fn(src))


def leaky_relu(input, negative_slope=0.01, inplace=False):
    """max(0, x) + negative_slope * min(0, x); the gradient at 0 is negative_slope (PyTorch's)."""
    if inplace:
        if negative_slope < 0:
            raise ValueError(f"leaky_relu: inplace=True needs negative_slope >= 0 (its backward reads the sign "
                             f"of the result), got {negative_slope}")
        with no_grad():
            scale = (input > 0).to(input.dtype) * (1.0 - negative_slope) + negative_slope
        return input.mul_(scale)
    return E.where(input > 0, input, input * negative_slope)


def leaky_relu_(input, negative_slope=0.01):
    return leaky_relu(input, negative_slope, inplace=True)


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    """Randomized leaky ReLU (Xu et al. 2015): in training each element x <= 0 is scaled by its own slope drawn
    uniformly from [lower, upper] (FLAME's random generator), and the gradient is that slope; in eval,
    leaky_relu with the mean slope (lower + upper) / 2."""
    if lower > upper:
        raise ValueError(f"rrelu: lower bound ({lower}) should be less than or equal to the upper bound ({upper})")
    if not input.dtype.is_floating_point:
        raise DTypeError(f"rrelu: expected a floating point input, got {input.dtype}")
    if not training:
        return leaky_relu(input, (lower + upper) / 2, inplace)
    with no_grad():
        drawn = C.rand(tuple(input.shape), dtype=input.dtype, device=input.device) * (upper - lower) + lower
        slope = E.where(input > 0, C.ones_like(drawn), drawn)
    return input.mul_(slope) if inplace else input * slope


def rrelu_(input, lower=1.0 / 8, upper=1.0 / 3, training=False):
    return rrelu(input, lower, upper, training, inplace=True)


def _elu(x, alpha):
    neg = (E.exp(E.clamp(x, max=0.0)) - 1.0) * alpha  # clamped: no inf in the unused branch's gradient
    return E.where(x > 0, x, neg)


def elu(input, alpha=1.0, inplace=False):
    """x for x > 0, alpha * (exp(x) - 1) otherwise."""
    return _inplace(lambda x: _elu(x, alpha), input) if inplace else _elu(input, alpha)


def elu_(input, alpha=1.0):
    return elu(input, alpha, inplace=True)


def softplus(input, beta=1.0, threshold=20.0):
    """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold."""
    return A.softplus(input, beta, threshold)


def _mish(x):
    return x * E.tanh(A.softplus(x))


def mish(input, inplace=False):
    """x * tanh(softplus(x))."""
    return _inplace(_mish, input) if inplace else _mish(input)


def _hardswish(x):
    return x * E.clamp(x + 3.0, 0.0, 6.0) * (1.0 / 6.0)


def hardswish(input, inplace=False):
    """x * relu6(x + 3) / 6."""
    return _inplace(_hardswish, input) if inplace else _hardswish(input)


# ----------------------------------------------------------------------------- the rest of PyTorch's activations
# Compositions of differentiable ops. Where PyTorch's gradient at a kink differs from the composition's (a bound of
# hardtanh, a threshold), the value outside the open interval comes from a detached tensor, so the gradient there is
# PyTorch's 0.
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _hardtanh(x, lo, hi):
    return E.where((x > lo) & (x < hi), x, E.clamp(x.detach(), lo, hi))


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    """min(max(x, min_val), max_val); the gradient is 1 strictly inside (min_val, max_val), else 0 (PyTorch's)."""
    if min_val > max_val:
        raise ValueError(f"hardtanh: min_val ({min_val}) must not be greater than max_val ({max_val})")
    return _inplace(lambda x: _hardtanh(x, min_val, max_val), input) if inplace else _hardtanh(input, min_val, max_val)


def hardtanh_(input, min_val=-1.0, max_val=1.0):
    return hardtanh(input, min_val, max_val, inplace=True)


def relu6(input, inplace=False):
    """hardtanh(x, 0, 6)."""
    return hardtanh(input, 0.0, 6.0, inplace)


def _hardsigmoid(x):
    return E.where((x > -3.0) & (x < 3.0), x * (1.0 / 6.0) + 0.5, E.clamp(x.detach() * (1.0 / 6.0) + 0.5, 0.0, 1.0))


def hardsigmoid(input, inplace=False):
    """relu6(x + 3) / 6; the gradient 1/6 strictly inside (-3, 3), else 0."""
    return _inplace(_hardsigmoid, input) if inplace else _hardsigmoid(input)


def logsigmoid(input):
    """log(sigmoid(x)), stable at both ends; the gradient sigmoid(-x) (DPO-style losses start at x = 0)."""
    return A.logsigmoid(input)


def softsign(input):
    """x / (1 + |x|)."""
    return input / (E.abs(input) + 1.0)


def tanhshrink(input):
    """x - tanh(x)."""
    return input - E.tanh(input)


def selu(input, inplace=False):
    """scale * elu(x, alpha) with SELU's constants (Klambauer et al.)."""
    f = lambda x: _elu(x, SELU_ALPHA) * SELU_SCALE  # noqa: E731
    return _inplace(f, input) if inplace else f(input)


def selu_(input):
    return selu(input, inplace=True)


def _celu(x, alpha):
    return E.where(x > 0, x, (E.exp(E.clamp(x, max=0.0) * (1.0 / alpha)) - 1.0) * alpha)


def celu(input, alpha=1.0, inplace=False):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    if alpha == 0:
        raise ValueError("celu: alpha must not be 0 (x / alpha)")
    return _inplace(lambda x: _celu(x, alpha), input) if inplace else _celu(input, alpha)


def celu_(input, alpha=1.0):
    return celu(input, alpha, inplace=True)


def _threshold(x, threshold, value):
    return E.where(x > threshold, x, C.full_like(x, value))


def threshold(input, threshold, value, inplace=False):
    """x where x > threshold, else `value` (no gradient there)."""
    if inplace:
        return _inplace(lambda x: _threshold(x, threshold, value), input)
    return _threshold(input, threshold, value)


def threshold_(input, threshold, value):
    return _inplace(lambda x: _threshold(x, threshold, value), input)


hardshrink = A.hardshrink   # (flame_core: also the Tensor method)


def softshrink(input, lambd=0.5):
    """x - lambd where x > lambd, x + lambd where x < -lambd, else 0."""
    if lambd < 0:
        raise ValueError(f"softshrink: lambd must be >= 0, got {lambd}")
    return E.where(input > lambd, input - lambd, E.where(input < -lambd, input + lambd, C.zeros_like(input)))


def softmin(input, dim=-1, dtype=None):
    """softmax(-x) along `dim` (-1 by default, as FLAME's softmax)."""
    return R.softmax(-input, dim, dtype=dtype)


def glu(input, dim=-1):
    """a * sigmoid(b) where input = [a | b] along `dim` (its size must be even)."""
    n = input.shape[dim]
    if n % 2:
        raise ValueError(f"glu: dimension {dim} of input {tuple(input.shape)} must have an even size, got {n}")
    a, b = input.chunk(2, dim)
    return a * E.sigmoid(b)


prelu = A.prelu   # (flame_core: also the Tensor method)
