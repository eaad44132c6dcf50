"""Activations and softmax (PyTorch names); the elementwise ops themselves live in flame_core."""
from flame_core.ops import activation as A, elementwise as E
from flame_core.ops import reduction as R


def relu(input, inplace=False):
    return input.relu_() if inplace else E.relu(input)


def gelu(input, approximate="none"):
    return A.gelu(input, approximate=approximate)


def silu(input, inplace=False):
    return input.silu_() if inplace else A.silu(input)


def tanh(input):
    return E.tanh(input)


def sigmoid(input):
    return E.sigmoid(input)


def softmax(input, dim=-1, dtype=None):
    return R.softmax(input, dim, dtype=dtype)


def log_softmax(input, dim=-1, dtype=None):
    return R.log_softmax(input, dim, dtype=dtype)
