"""Stochastic rounding of float32 values to bfloat16, bit for bit as the optimizer kernels do it (cuda_src/
optim_grads.cuh: sr_mix, sr_bits, sr_bf16): 16 random bits added below bfloat16's last place, then truncated, so
a value rounds up with probability equal to the fraction it drops -- a weight kept in bfloat16 takes updates far
below its spacing on average instead of losing every one of them (kohya's full_bf16, OneTrainer's stochastic
rounding). The bits are a hash of (seed: the step, salt: the tensor's ordinal, the element's flat index): the same
on the CPU and the GPU, and the same on a resumed run. inf and NaN pass unchanged.

    to_bf16_stochastic(x, seed, salt)   # x: float32 NumPy or CuPy array -> bfloat16 array of its shape
"""
import ml_dtypes
import numpy as np

from .. import backend

_GOLDEN = 0x9E3779B9


def _mix(x):
    """sr_mix on uint32 arrays (products wrap modulo 2^32 as in C)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def sr_bits(seed, salt, n, xp=np):
    """The 32 random bits of elements 0..n-1 of tensor `salt` at `seed` (uint32 array of n)."""
    s = _mix(np.asarray([(int(salt) + _GOLDEN) & 0xFFFFFFFF], dtype=np.uint32))
    s = _mix(np.uint32(int(seed) & 0xFFFFFFFF) ^ s)
    i = xp.arange(n, dtype=np.uint64)
    lo = (i & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = _mix((i >> np.uint64(32)).astype(np.uint32))
    return _mix(xp.asarray(s) ^ lo ^ hi)


def to_bf16_stochastic(x, seed, salt):
    """float32 array `x` (flat index order = C order) stochastically rounded to bfloat16 with the kernels' bits."""
    xp = backend.xp_of(x)
    x = xp.ascontiguousarray(x, dtype=np.float32)
    u = x.reshape(-1).view(np.uint32)
    r = sr_bits(seed, salt, u.size, xp) & np.uint32(0xFFFF)
    finite = (u & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    u = xp.where(finite, u + r, u)
    return (u >> np.uint32(16)).astype(np.uint16).view(ml_dtypes.bfloat16).reshape(x.shape)
