"""3-D pooling (PyTorch's max_pool3d, avg_pool3d, adaptive_avg_pool3d, adaptive_max_pool3d) as two 2-D poolings:
a box window is a height x width window per depth followed by a depth window, and both max and average separate
that way -- max: the (height, width) maxima, then the maximum over the depth taps, which is PyTorch's scan order
(depth outermost: the first maximum, or the last NaN, wins, and takes the gradient); average: PyTorch's divisor of a
window (the kernel's size, or with ceil_mode / count_include_pad=False the cells counted per side) is the product of
the per-side counts. The depth stage is the 2-D op over (D, H' * W') with a (kD, 1) kernel, so padding, dilation,
ceil_mode and their checks are the 2-D ops' own. return_indices: the depth stage's maximum names the depth, whose
(height, width) index the first stage gave -- PyTorch's flat d * H * W + h * W + w. Inputs (N, C, D, H, W) or
(C, D, H, W)."""
import numpy as np

from .. import backend
from ..errors import ShapeError, fmt_shape
from ..tensor import _wrap
from . import pooling as P


def _triple(v, name, op):
    if isinstance(v, int):
        return (v, v, v)
    v = tuple(int(a) for a in v)
    if len(v) == 1:
        return v * 3
    if len(v) != 3:
        raise ValueError(f"{op}: {name} must be an int or a triple, got {v}")
    return v


def _five(op, input):
    if input.ndim not in (4, 5):
        raise ShapeError(f"{op}: expected (N, C, D, H, W) or (C, D, H, W), got {fmt_shape(input.shape)}")
    return (input.unsqueeze(0), True) if input.ndim == 4 else (input, False)


def _separable(op, input, stage_hw, stage_d, return_indices=False):
    """stage_hw on the (N * D, C, H, W) slices, then stage_d on (N, C, D, H' * W'). With return_indices both stages
    return (output, indices) and the result's indices are the flat positions d * H * W + h * W + w in each input
    volume (PyTorch's): the depth stage's index picks the depth, whose (height, width) index is gathered."""
    x, unbatched = _five(op, input)
    N, C, D, H, W = x.shape
    y = stage_hw(x.permute(0, 2, 1, 3, 4).reshape(N * D, C, H, W))        # (N * D, C, H', W')
    y, hw_idx = y if return_indices else (y, None)
    Ho, Wo = y.shape[2:]
    y = y.reshape(N, D, C, Ho * Wo).permute(0, 2, 1, 3)                    # (N, C, D, H' * W')
    y = stage_d(y)                                                          # (N, C, D', H' * W')
    y, d_idx = y if return_indices else (y, None)
    Do = y.shape[2]
    y = y.reshape(N, C, Do, Ho, Wo)
    if return_indices:
        xp = backend.xp_of(d_idx._data)
        hw = xp.transpose(hw_idx._data.reshape(N, D, C, Ho * Wo), (0, 2, 1, 3))   # (N, C, D, H' * W')
        d_sel = d_idx._data // (Ho * Wo)                                    # each maximum's input depth
        idx = d_sel * (H * W) + xp.take_along_axis(hw, d_sel, axis=2)
        ind = _wrap(idx.reshape(N, C, Do, Ho, Wo).astype(np.int64, copy=False))
        return (y.squeeze(0), ind.squeeze(0)) if unbatched else (y, ind)
    return y.squeeze(0) if unbatched else y


def max_pool3d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """PyTorch's max_pool3d; with return_indices=True, (output, indices): each maximum's flat position
    d * H * W + h * W + w in its input volume, int64."""
    k = _triple(kernel_size, "kernel_size", "max_pool3d")
    s = k if stride is None or stride == () else _triple(stride, "stride", "max_pool3d")
    p, d = _triple(padding, "padding", "max_pool3d"), _triple(dilation, "dilation", "max_pool3d")
    ri = bool(return_indices)
    return _separable("max_pool3d", input,
                      lambda t: P.max_pool2d(t, k[1:], s[1:], p[1:], d[1:], ceil_mode, ri),
                      lambda t: P.max_pool2d(t, (k[0], 1), (s[0], 1), (p[0], 0), (d[0], 1), ceil_mode, ri), ri)


def avg_pool3d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    k = _triple(kernel_size, "kernel_size", "avg_pool3d")
    s = k if stride is None or stride == () else _triple(stride, "stride", "avg_pool3d")
    p = _triple(padding, "padding", "avg_pool3d")
    if divisor_override is not None and divisor_override <= 0:
        raise ValueError(f"avg_pool3d: divisor_override must be positive, got {divisor_override}")
    hw_div = 1 if divisor_override is not None else None   # with an override: sums, then one division by it
    return _separable("avg_pool3d", input,
                      lambda t: P.avg_pool2d(t, k[1:], s[1:], p[1:], ceil_mode, count_include_pad, hw_div),
                      lambda t: P.avg_pool2d(t, (k[0], 1), (s[0], 1), (p[0], 0), ceil_mode, count_include_pad,
                                             divisor_override))


def _out3(output_size, D, H, W, op):
    o = (output_size,) * 3 if isinstance(output_size, int) or output_size is None else tuple(output_size)
    if len(o) != 3:
        raise ValueError(f"{op}: output_size must be an int or a triple, got {output_size}")
    return tuple(int(v) if v is not None else n for v, n in zip(o, (D, H, W)))


def adaptive_avg_pool3d(input, output_size):
    x, _ = _five("adaptive_avg_pool3d", input)
    od, oh, ow = _out3(output_size, *x.shape[2:], "adaptive_avg_pool3d")
    return _separable("adaptive_avg_pool3d", input, lambda t: P.adaptive_avg_pool2d(t, (oh, ow)),
                      lambda t: P.adaptive_avg_pool2d(t, (od, t.shape[3])))


def adaptive_max_pool3d(input, output_size, return_indices=False):
    """The maximum over PyTorch's adaptive windows; with return_indices also the flat positions d * H * W +
    h * W + w (int64)."""
    x, _ = _five("adaptive_max_pool3d", input)
    od, oh, ow = _out3(output_size, *x.shape[2:], "adaptive_max_pool3d")
    ri = bool(return_indices)
    return _separable("adaptive_max_pool3d", input, lambda t: P.adaptive_max_pool2d(t, (oh, ow), ri),
                      lambda t: P.adaptive_max_pool2d(t, (od, t.shape[3]), ri), ri)
