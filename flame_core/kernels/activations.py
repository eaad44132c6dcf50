"""GELU (erf / tanh) and SiLU on arrays: raw kernels on CuPy (cuda_src/activations.cu), reference on `xp` otherwise.

Every function takes and returns arrays of x's dtype; float16 / bfloat16 compute in float32, float64 in float64.
"""
import math

import numpy as np

from . import loader as L

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_np_erf = np.frompyfunc(math.erf, 1, 1)


def _erf(xp, a):
    if xp is np:
        return np.asarray(_np_erf(a.astype(np.float64)), dtype=np.float64).astype(a.dtype)
    from cupyx.scipy.special import erf
    return erf(a)


def _approx_flag(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return 1 if approximate == "tanh" else 0


# ----------------------------------------------------------------------------- references (the oracle)
def _sigmoid_pair(xp, z):
    """(sigmoid(z), 1 - sigmoid(z)) without cancellation in either tail (1 + tanh(u) loses all digits for u << 0)."""
    e = xp.exp(-xp.abs(z))
    p, q = 1 / (1 + e), e / (1 + e)
    pos = z >= 0
    return xp.where(pos, p, q), xp.where(pos, q, p)


def _gelu_ref(x, approximate):
    xp = L.xp_of(x)
    a = x.astype(L.compute_dtype(x.dtype))
    if approximate == "tanh":  # 0.5 a (1 + tanh(u)) = a sigmoid(2u)
        y = a * _sigmoid_pair(xp, 2 * _SQRT_2_OVER_PI * (a + 0.044715 * a * a * a))[0]
    else:
        y = 0.5 * a * (1 + _erf(xp, a * _INV_SQRT2))
    return y.astype(x.dtype)


def _gelu_grad_ref(dy, x, approximate):
    xp = L.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    a, g = x.astype(cd), dy.astype(cd)
    if approximate == "tanh":  # d/da [a s(2u)] = s + 2 a s (1 - s) u'
        s, q = _sigmoid_pair(xp, 2 * _SQRT_2_OVER_PI * (a + 0.044715 * a * a * a))
        d = s + 2 * a * s * q * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * a * a)
    else:
        d = 0.5 * (1 + _erf(xp, a * _INV_SQRT2)) + a * _INV_SQRT_2PI * xp.exp(-0.5 * a * a)
    return (g * d).astype(x.dtype)


def _silu_ref(x):
    xp = L.xp_of(x)
    a = x.astype(L.compute_dtype(x.dtype))
    return (a * _sigmoid_pair(xp, a)[0]).astype(x.dtype)


def _silu_grad_ref(dy, x):
    xp = L.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    a, g = x.astype(cd), dy.astype(cd)
    s, q = _sigmoid_pair(xp, a)
    return (g * s * (1 + a * q)).astype(x.dtype)


# ----------------------------------------------------------------------------- kernels
_UNROLL = 4   # 16-byte vectors per thread and loop step: ACT_UNROLL in cuda_src/activations.cu
_BLOCK = 256


def _grid(n, dtype):
    """One loop step per thread for the sizes that matter (the grid covers the data, as PyTorch's elementwise kernels
    do); past 64 blocks per SM the kernels' grid-stride loop takes the rest."""
    blocks = L.cdiv(n // L.vec_width(dtype), _BLOCK * _UNROLL)
    return (max(1, min(blocks, L.sm_count() * 64)),), (_BLOCK,)


def _unary(name, x, *extra):
    x = L.contiguous(x)
    y = L.xp_of(x).empty_like(x)
    grid, block = _grid(x.size, x.dtype)
    L.launch(L.get_function("activations", name, x.dtype), grid, block, (x, y, L.i64(x.size)) + extra)
    return y


def _binary(name, dy, x, *extra):
    if dy.shape != x.shape:
        raise ValueError(f"{name}: gradient shape {dy.shape} differs from input shape {x.shape}")
    x, dy = L.contiguous(x), L.contiguous(dy.astype(x.dtype, copy=False))
    dx = L.xp_of(x).empty_like(x)
    grid, block = _grid(x.size, x.dtype)
    L.launch(L.get_function("activations", name, x.dtype), grid, block, (dy, x, dx, L.i64(x.size)) + extra)
    return dx


# ----------------------------------------------------------------------------- API
def gelu_forward(x, approximate="none"):
    flag = _approx_flag(approximate)
    if L.use_kernel(x) and x.size:
        return _unary("gelu_fwd", x, L.i32(flag))
    return _gelu_ref(x, approximate)


def gelu_backward(dy, x, approximate="none"):
    flag = _approx_flag(approximate)
    if L.use_kernel(x) and x.size:
        return _binary("gelu_bwd", dy, x, L.i32(flag))
    return _gelu_grad_ref(dy, x, approximate)


def silu_forward(x):
    if L.use_kernel(x) and x.size:
        return _unary("silu_fwd", x)
    return _silu_ref(x)


def silu_backward(dy, x):
    if L.use_kernel(x) and x.size:
        return _binary("silu_bwd", dy, x)
    return _silu_grad_ref(dy, x)
