"""The pooling functionals PyTorch has beyond flame_core.ops.pooling / pooling3d: the *_with_indices names (the
poolings with return_indices=True) and max_unpool1d / max_unpool3d (max_unpool2d is flame_core's)."""
import math

import flame_core as flame
from flame_core.errors import DTypeError, ShapeError, fmt_shape
from flame_core.ops.pooling import (
    adaptive_max_pool1d,
    adaptive_max_pool2d,
    max_pool1d,
    max_pool2d,
    max_unpool2d,
)
from flame_core.ops.pooling3d import adaptive_max_pool3d, max_pool3d


# PyTorch's *_with_indices: its return_indices argument is accepted and ignored (the indices always come back)
def max_pool1d_with_indices(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                            return_indices=False):
    return max_pool1d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)


def max_pool2d_with_indices(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                            return_indices=False):
    return max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)


def max_pool3d_with_indices(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                            return_indices=False):
    return max_pool3d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)


def adaptive_max_pool1d_with_indices(input, output_size, return_indices=False):
    return adaptive_max_pool1d(input, output_size, return_indices=True)


def adaptive_max_pool2d_with_indices(input, output_size, return_indices=False):
    return adaptive_max_pool2d(input, output_size, return_indices=True)


def adaptive_max_pool3d_with_indices(input, output_size, return_indices=False):
    return adaptive_max_pool3d(input, output_size, return_indices=True)


def _tuple(v, n, name):
    t = (v,) * n if isinstance(v, int) else tuple(int(a) for a in v)
    if len(t) != n:
        raise ValueError(f"{name} must be an int or {n} ints, got {v}")
    return t


def _unpool_geometry(op, input, indices, dims, kernel_size, stride, padding, output_size):
    """(kernel, stride, padding, output size) of a max_unpool over the last `dims` dimensions: each side
    (in - 1) * stride - 2 * padding + kernel, or `output_size` (the spatial sizes, or the whole shape) within a stride
    of that, as PyTorch's."""
    if input.ndim not in (dims + 1, dims + 2):
        raise ShapeError(f"{op}: expected a {dims + 1}-D (unbatched) or {dims + 2}-D input, got "
                         f"{fmt_shape(input.shape)}")
    if tuple(indices.shape) != tuple(input.shape):
        raise ShapeError(f"{op}: indices of shape {fmt_shape(indices.shape)} do not match the input's "
                         f"{fmt_shape(input.shape)}")
    if indices.dtype not in (flame.int64, flame.int32):
        raise DTypeError(f"{op}: indices must be int64 (the pooling's return_indices), got {indices.dtype}")
    k = _tuple(kernel_size, dims, f"{op}: kernel_size")
    s = _tuple(stride if stride is not None else kernel_size, dims, f"{op}: stride")
    p = _tuple(padding, dims, f"{op}: padding")
    default = tuple((n - 1) * s_ - 2 * p_ + k_ for n, k_, s_, p_ in zip(input.shape[-dims:], k, s, p))
    if output_size is None:
        return k, s, p, default
    size = tuple(int(v) for v in output_size)
    if len(size) == dims + 2:
        size = size[2:]
    if len(size) != dims:
        raise ValueError(f"{op}: output_size should be a sequence containing {dims} or {dims + 2} elements, but it "
                         f"has a length of '{len(size)}'")
    for d, (n, n0, s_) in enumerate(zip(size, default, s)):
        if not n0 - s_ < n < n0 + s_:
            raise ValueError(f'{op}: invalid output_size "{size}" (dim {d} must be between {n0 - s_} and '
                             f'{n0 + s_})')
    return k, s, p, size


def max_unpool1d(input, indices, kernel_size, stride=None, padding=0, output_size=None):
    """The inverse of max_pool1d(return_indices=True): input (N, C, L) or (C, L) and its indices (positions along
    the output's L) -> zeros with each value at its index (max_unpool2d over (N, C, 1, L), as PyTorch's)."""
    k, s, p, size = _unpool_geometry("max_unpool1d", input, indices, 1, kernel_size, stride, padding, output_size)
    out = max_unpool2d(input.unsqueeze(-2), indices.unsqueeze(-2), (1, k[0]), (1, s[0]), (0, p[0]), (1, size[0]))
    return out.squeeze(-2)


def max_unpool3d(input, indices, kernel_size, stride=None, padding=0, output_size=None):
    """The inverse of max_pool3d(return_indices=True): input (N, C, D, H, W) or (C, D, H, W) and its indices (flat
    positions d * H * W + h * W + w in each output volume) -> zeros with each value at its index; the gradient is
    gathered back from there."""
    _, _, _, size = _unpool_geometry("max_unpool3d", input, indices, 3, kernel_size, stride, padding, output_size)
    lead = tuple(input.shape[:-3])
    volume = math.prod(size)
    idx = indices.reshape(*lead, -1).long()
    if idx.numel() and bool(((idx < 0) | (idx >= volume)).any()):
        raise IndexError(f"max_unpool3d: indices range over [{int(idx.min())}, {int(idx.max())}], outside the "
                         f"{size} output volume (0 .. {volume - 1})")
    out = flame.zeros(lead + (volume,), dtype=input.dtype, device=input.device)
    return out.scatter(-1, idx, input.reshape(*lead, -1)).reshape(*lead, *size)
