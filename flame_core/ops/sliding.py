"""Tensor.unfold(dimension, size, step): every window of `size` elements along `dimension`, `step` apart, as a strided
view with the windows' elements in a new last dimension (PyTorch's; the image im2col is F.unfold, ops/im2col.py).

Windows overlap when step < size, so the view must not be written: on the CPU its array is read-only (an in-place op
on it raises), on cuda nothing stops a write (PyTorch refuses one).
"""
from .. import backend
from ..autograd.function import Function
from ..errors import ShapeError, fmt_shape
from ..tensor import _view_of, _wrap
from .shape import _norm_dim


def _windows(a, d, size, step):
    n = (a.shape[d] - size) // step + 1
    shape = a.shape[:d] + (n,) + a.shape[d + 1:] + (size,)
    strides = a.strides[:d] + (a.strides[d] * step,) + a.strides[d + 1:] + (a.strides[d],)
    tricks = backend.xp_of(a).lib.stride_tricks
    if backend.is_cuda_array(a):
        return tricks.as_strided(a, shape, strides)
    return tricks.as_strided(a, shape, strides, writeable=False)


class Unfold(Function):
    @staticmethod
    def forward(ctx, x, d, size, step):
        ctx.shape, ctx.d, ctx.size, ctx.step = x._data.shape, d, size, step
        return _view_of(_windows(x._data, d, size, step), x)

    @staticmethod
    def backward(ctx, g):
        return FoldAdd.apply(g, ctx.shape, ctx.d, ctx.size, ctx.step), None, None, None


class FoldAdd(Function):
    """unfold's adjoint: each window's values added back where the window came from, one strided add per offset in
    the window (windows `step` apart do not overlap within one offset). Its own backward is unfold again."""

    @staticmethod
    def forward(ctx, g, shape, d, size, step):
        ctx.d, ctx.size, ctx.step = d, size, step
        ga = g._data
        out = backend.xp_of(ga).zeros(shape, dtype=ga.dtype)
        n = ga.shape[d]
        lead = (slice(None),) * d
        for k in range(size):
            out[lead + (slice(k, k + (n - 1) * step + 1, step),)] += ga[..., k]
        return _wrap(out)

    @staticmethod
    def backward(ctx, gg):
        return Unfold.apply(gg, ctx.d, ctx.size, ctx.step), None, None, None, None


def unfold(x, dimension, size, step):
    """PyTorch's Tensor.unfold: a view of every `size`-element window along `dimension`, `step` apart; shape x's with
    dimension's size replaced by the window count (size - `size`) // step + 1, and `size` appended."""
    if x.ndim == 0:   # PyTorch: one element along dim 0 / -1, its one window of `size` (<= 1) elements
        r = unfold(x.reshape(1), dimension, size, step)
        return r.reshape(r.shape[1:]) if r.shape[0] == 1 else r
    d = _norm_dim(dimension, x.ndim, "unfold")
    n = x._data.shape[d]
    if not isinstance(size, int) or not isinstance(step, int) or size < 0 or step <= 0:
        raise ValueError(f"unfold: size must be >= 0 and step > 0 (integers), got size={size!r}, step={step!r}")
    if size > n:
        raise ShapeError(f"unfold: size {size} exceeds dimension {d} of size {n} (shape {fmt_shape(x.shape)})")
    return Unfold.apply(x, d, size, step)
