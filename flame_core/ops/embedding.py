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
    if input.numel() and _out_of_range(input._data, weight.shape[0]):
        lo, hi = int(input.min()), int(input.max())
        raise IndexError(f"embedding: index out of range: indices span [{lo}, {hi}] for {weight.shape[0]} rows")
    return Embedding.apply(input, weight, padding_idx)


_oob_kernel = None


def _out_of_range(ia, n):
    """Whether any index lies outside [0, n): on cuda one reduction kernel and one device-to-host read (a min and a
    max were two of each: the eager embedding's host cost)."""
    xp = backend.xp_of(ia)
    if xp is np:
        return bool(ia.min() < 0 or ia.max() >= n)
    global _oob_kernel
    if _oob_kernel is None:
        _oob_kernel = xp.ReductionKernel("T x, int64 n", "int32 bad", "(x < 0 || x >= n) ? 1 : 0", "a | b",
                                         "bad = a", "0", "flame_embedding_out_of_range")
    return bool(_oob_kernel(ia, n))
