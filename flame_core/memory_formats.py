"""Memory formats, as torch's: the order in which a 4-D (N, C, H, W) tensor's elements lie in memory. The shape and
every op's result stay the same in either; only the strides differ.

    contiguous_format   N, C, H, W (row-major; the default)
    channels_last       N, H, W, C - the layout the implicit-GEMM convolution reads (cuda_src/conv_*.cu): a conv
                        given a channels-last input of a multiple of 8 channels reads it in place instead of making
                        its NHWC copy. F.group_norm / F.group_norm_silu can write their output channels-last in the
                        same pass (memory_format=), so no transpose sits between a ResBlock's norm and its conv.
    preserve_format     clone's default: the input's format where it is one of the two, else contiguous_format

`Tensor.contiguous(memory_format=)`, `Tensor.is_contiguous(memory_format=)` and `clone(x, memory_format=)` take
them. An array is channels-last when its (N, H, W, C) transpose is C-contiguous.
"""


class memory_format:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"flame.{self.name}"


contiguous_format = memory_format("contiguous_format")
channels_last = memory_format("channels_last")
preserve_format = memory_format("preserve_format")
_FORMATS = (contiguous_format, channels_last, preserve_format)


def check(fmt, op, allow_preserve=True):
    """fmt, or a TypeError / ValueError naming op when it is not a memory format op takes."""
    if not isinstance(fmt, memory_format) or fmt not in _FORMATS:
        raise TypeError(f"{op}: memory_format must be flame.contiguous_format, flame.channels_last or "
                        f"flame.preserve_format, got {fmt!r}")
    if fmt is preserve_format and not allow_preserve:
        raise ValueError(f"{op}: memory_format=flame.preserve_format is not supported here")
    return fmt


def is_channels_last(a):
    """Whether array a (any 4-D array) lies in memory as N, H, W, C."""
    return a.ndim == 4 and a.transpose(0, 2, 3, 1).flags.c_contiguous


def is_contiguous(a, fmt):
    """Whether array a is contiguous in memory format fmt (contiguous_format or channels_last)."""
    if fmt is channels_last:
        if a.ndim != 4:
            raise ValueError(f"channels_last is a format of 4-D tensors; this one has shape {tuple(a.shape)}")
        return is_channels_last(a)
    return bool(a.flags.c_contiguous)


def suggested(a):
    """preserve_format's choice for array a: channels_last when a is channels-last and not also C-contiguous (a
    size-1 channel or spatial dim makes both true), else contiguous_format."""
    return channels_last if is_channels_last(a) and not a.flags.c_contiguous else contiguous_format


def empty(shape, dtype, xp, fmt):
    """An uninitialised array of `shape` (4-D for channels_last) laid out in fmt."""
    if fmt is channels_last:
        N, C, H, W = shape
        return xp.empty((N, H, W, C), dtype=dtype).transpose(0, 3, 1, 2)
    return xp.empty(shape, dtype=dtype)


def to_format(a, fmt, copy=False):
    """Array a in memory format fmt (contiguous_format or channels_last): a itself when it already is and no copy is
    asked for, else a copy (one device memcpy where the source is already dense in the target order)."""
    from . import backend
    xp = backend.xp_of(a)
    if fmt is channels_last:
        if a.ndim != 4:
            raise ValueError(f"channels_last is a format of 4-D tensors; this one has shape {tuple(a.shape)}")
        if is_channels_last(a) and not copy:
            return a
        t = a.transpose(0, 2, 3, 1)
        return (backend.copy_array(t) if t.flags.c_contiguous else xp.ascontiguousarray(t)).transpose(0, 3, 1, 2)
    if a.flags.c_contiguous and not copy:
        return a
    return backend.copy_array(a) if a.flags.c_contiguous else xp.ascontiguousarray(a)
