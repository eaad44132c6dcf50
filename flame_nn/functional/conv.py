"""conv1d and conv_transpose1d (the 2-D ones over a height of one) and conv_transpose2d
(flame_core.ops.conv_transpose)."""
from flame_core.errors import ShapeError, fmt_shape
from flame_core.ops.conv import conv2d
from flame_core.ops.conv_transpose import conv_transpose2d


def _one(v, name):
    if isinstance(v, int):
        return v
    v = tuple(v)
    if len(v) != 1:
        raise ValueError(f"conv1d: {name} must be an int or a 1-tuple, got {v}")
    return int(v[0])


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """input (N, C, L) or (C, L), weight (O, C/groups, K); padding an int, 'valid' or 'same'."""
    if weight.ndim != 3 or input.ndim not in (2, 3):
        raise ShapeError(f"conv1d expects input (N, C, L) or (C, L) and weight (O, C/groups, K), got "
                         f"{fmt_shape(input.shape)} and {fmt_shape(weight.shape)}")
    unbatched = input.ndim == 2
    x = input.unsqueeze(0) if unbatched else input
    pad = padding if isinstance(padding, str) else (0, _one(padding, "padding"))
    y = conv2d(x.unsqueeze(2), weight.unsqueeze(2), bias, (1, _one(stride, "stride")), pad,
               (1, _one(dilation, "dilation")), groups)                 # (N, O, 1, L')
    y = y.squeeze(2)
    return y.squeeze(0) if unbatched else y


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """input (N, Cin, L) or (Cin, L), weight (Cin, Cout/groups, K) -> (N, Cout, L') with L' = (L - 1) * stride -
    2 * padding + dilation * (K - 1) + output_padding + 1."""
    if weight.ndim != 3 or input.ndim not in (2, 3):
        raise ShapeError(f"conv_transpose1d expects input (N, C, L) or (C, L) and weight (Cin, Cout/groups, K), "
                         f"got {fmt_shape(input.shape)} and {fmt_shape(weight.shape)}")
    unbatched = input.ndim == 2
    x = input.unsqueeze(0) if unbatched else input
    y = conv_transpose2d(x.unsqueeze(2), weight.unsqueeze(2), bias, (1, _one(stride, "stride")),
                         (0, _one(padding, "padding")), (0, _one(output_padding, "output_padding")), groups,
                         (1, _one(dilation, "dilation"))).squeeze(2)
    return y.squeeze(0) if unbatched else y


__all__ = ["conv1d", "conv_transpose1d", "conv_transpose2d"]
