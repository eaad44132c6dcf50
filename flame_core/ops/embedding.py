"""embedding: rows of `weight` picked by integer `input`; the row at padding_idx gets no gradient."""
import numpy as np

from .. import backend
from ..autograd.function import Function
from ..errors import DTypeError, ShapeError, fmt_shape
from ..tensor import _wrap, check_same_device
from .indexing import _add_at


class Embedding(Function):
    @staticmethod
    def forward(ctx, idx, weight, padding_idx):
        ia = idx._data.reshape(-1)
        w = weight._data
        xp = backend.xp_of(w)
        out = xp.take(w, ia, axis=0)
        ctx.idx, ctx.padding_idx, ctx.wshape = ia, padding_idx, w.shape
        return _wrap(out.reshape(idx._data.shape + (w.shape[1],)))

    @staticmethod
    def backward(ctx, g):
        ga = g._data.reshape(-1, ctx.wshape[1])
        xp = backend.xp_of(ga)
        acc = np.float32 if ga.dtype.itemsize < 4 else ga.dtype
        gw = xp.zeros(ctx.wshape, dtype=acc)
        _add_at(xp, gw, ctx.idx, ga.astype(acc, copy=False))
        if ctx.padding_idx is not None:
            gw[ctx.padding_idx] = 0
        return None, _wrap(gw.astype(ga.dtype, copy=False)), None


def embedding(input, weight, padding_idx=None):
    check_same_device("embedding", input, weight)
    if input.dtype.is_floating_point or input.dtype.name == "bool":
        raise DTypeError(f"embedding: indices must be integers, got {input.dtype}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be (num_embeddings, dim), got {fmt_shape(weight.shape)}")
    if input.numel():
        lo, hi = int(input.min()), int(input.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise IndexError(f"embedding: index out of range: indices span [{lo}, {hi}] for {weight.shape[0]} rows")
    return Embedding.apply(input, weight, padding_idx)
