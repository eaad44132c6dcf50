"""Activations and softmax (PyTorch names); the elementwise ops themselves live in flame_core. The activations
without a kernel of their own are compositions of differentiable Tensor ops (so they also have double backward)."""
from flame_core.autograd import is_grad_enabled, no_grad
from flame_core.ops import activation as A
from flame_core.ops import elementwise as E
from flame_core.ops import reduction as R


def relu(input, inplace=False):
    return input.relu_() if inplace else E.relu(input)


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


def _elu(x, alpha):
    neg = (E.exp(E.clamp(x, max=0.0)) - 1.0) * alpha  # clamped: no inf in the unused branch's gradient
    return E.where(x > 0, x, neg)


def elu(input, alpha=1.0, inplace=False):
    """x for x > 0, alpha * (exp(x) - 1) otherwise."""
    return _inplace(lambda x: _elu(x, alpha), input) if inplace else _elu(input, alpha)


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
