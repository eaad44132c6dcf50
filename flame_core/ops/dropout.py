"""dropout as one autograd op on cuda: the draw, the mask and the product in one kernel (flame_core/kernels/
dropout.py), the mask kept for the backward (g * mask). The same numbers as the composed path (`rand(...) >= p`,
`.to(dtype) * scale`, `x * mask`) at the same generator state, which advances as that draw's would."""
from .. import dtypes as D
from .. import random as _random
from ..autograd.function import Function
from ..kernels import dropout as _k
from ..tensor import _wrap
from .elementwise import _grad_mul


class FusedDropout(Function):
    @staticmethod
    def forward(ctx, x, p, seed, offset):
        y, mask = _k.dropout(x._data, p, seed, offset)
        ctx.mask = mask
        return _wrap(y)

    @staticmethod
    def backward(ctx, g):
        return _grad_mul(g, _wrap(ctx.mask)), None, None, None


def fused_dropout(input, p, generator=None):
    """Elementwise dropout of `input` at rate p (0 < p <= 1, training) in one kernel, or None where it does not apply:
    not a C-contiguous cuda tensor of float32 / float16 / bfloat16 on the current device, kernels disabled, a
    generator of another device, or a half-precision input while the default dtype is not float32 (the composed
    path then draws in that dtype)."""
    x = input._data
    if not _k.applies(x):
        return None
    if x.dtype.itemsize < 4 and D.get_default_dtype() is not D.float32:
        return None
    g = generator if generator is not None else _random.default_generator(input.device)
    rng = g._rng
    if not isinstance(rng, _random._CudaPhilox) or g.device != input.device:
        return None
    offset = rng.reserve(x.size)
    return FusedDropout.apply(input, p, rng.seed, offset)
