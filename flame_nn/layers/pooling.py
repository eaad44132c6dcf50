"""Max / average / adaptive poolings in 1, 2 and 3 dimensions, MaxUnpool1d / 2d / 3d, Upsample."""
from .. import functional as F
from ..module import Module


class _MaxPoolNd(Module):
    """MaxPool1d / 2d / 3d: PyTorch's arguments; the dimension's function is the class's _fn."""
    _fn = None

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.dilation, self.ceil_mode = padding, dilation, ceil_mode
        self.return_indices = return_indices

    def forward(self, input):
        return type(self)._fn(input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                              self.return_indices)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class MaxPool2d(_MaxPoolNd):
    _fn = staticmethod(F.max_pool2d)


class _MaxUnpoolNd(Module):
    """The inverse of MaxPoolNd(return_indices=True): forward(input, indices, output_size=None); the arguments kept
    as `_dims`-tuples, as PyTorch's (the functional form in `_fn`)."""
    _fn, _dims = None, 0

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        n = self._dims
        self.kernel_size = (kernel_size,) * n if isinstance(kernel_size, int) else tuple(kernel_size)
        stride = self.kernel_size if stride is None else stride
        self.stride = (stride,) * n if isinstance(stride, int) else tuple(stride)
        self.padding = (padding,) * n if isinstance(padding, int) else tuple(padding)

    def forward(self, input, indices, output_size=None):
        return type(self)._fn(input, indices, self.kernel_size, self.stride, self.padding, output_size)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxUnpool1d(_MaxUnpoolNd):
    _fn, _dims = staticmethod(F.max_unpool1d), 1


class MaxUnpool2d(_MaxUnpoolNd):
    _fn, _dims = staticmethod(F.max_unpool2d), 2


class MaxUnpool3d(_MaxUnpoolNd):
    _fn, _dims = staticmethod(F.max_unpool3d), 3


class _AvgPoolNd(Module):
    """AvgPool2d's and AvgPool3d's arguments (the functional form in `_fn`)."""
    _fn = None

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.ceil_mode = padding, ceil_mode
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, input):
        return type(self)._fn(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                              self.count_include_pad, self.divisor_override)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(_AvgPoolNd):
    _fn = staticmethod(F.avg_pool2d)


class _AdaptivePoolNd(Module):
    """The adaptive poolings' output_size (the functional form in `_fn`)."""
    _fn = None

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, input):
        return type(self)._fn(input, self.output_size)

    def extra_repr(self):
        return f"output_size={self.output_size}"


class AdaptiveAvgPool2d(_AdaptivePoolNd):
    _fn = staticmethod(F.adaptive_avg_pool2d)


class Upsample(Module):
    def __init__(self, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None):
        super().__init__()
        self.size, self.scale_factor, self.mode, self.align_corners = size, scale_factor, mode, align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input):
        return F.interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners,
                             self.recompute_scale_factor)

    def extra_repr(self):
        s = f"size={self.size}" if self.size is not None else f"scale_factor={float(self.scale_factor)}"
        return s + f", mode='{self.mode}'"


class UpsamplingNearest2d(Upsample):
    """Upsample with mode 'nearest' (PyTorch's older name)."""

    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """Upsample with mode 'bilinear' and align_corners=True (PyTorch's older name, its corner alignment)."""

    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


class MaxPool1d(_MaxPoolNd):
    _fn = staticmethod(F.max_pool1d)


class AvgPool1d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.ceil_mode, self.count_include_pad = padding, ceil_mode, count_include_pad

    def forward(self, input):
        return F.avg_pool1d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool1d(AdaptiveAvgPool2d):
    def forward(self, input):
        return F.adaptive_avg_pool1d(input, self.output_size)


class _AdaptiveMaxPoolNd(Module):
    """The adaptive max poolings' output_size and return_indices (the functional form in `_fn`)."""
    _fn = None

    def __init__(self, output_size, return_indices=False):
        super().__init__()
        self.output_size, self.return_indices = output_size, return_indices

    def forward(self, input):
        return type(self)._fn(input, self.output_size, self.return_indices)

    def extra_repr(self):
        return f"output_size={self.output_size}"


class AdaptiveMaxPool1d(_AdaptiveMaxPoolNd):
    _fn = staticmethod(F.adaptive_max_pool1d)


class AdaptiveMaxPool2d(_AdaptiveMaxPoolNd):
    _fn = staticmethod(F.adaptive_max_pool2d)


class MaxPool3d(_MaxPoolNd):
    _fn = staticmethod(F.max_pool3d)


class AvgPool3d(_AvgPoolNd):
    _fn = staticmethod(F.avg_pool3d)


class AdaptiveAvgPool3d(_AdaptivePoolNd):
    _fn = staticmethod(F.adaptive_avg_pool3d)


class AdaptiveMaxPool3d(_AdaptiveMaxPoolNd):
    _fn = staticmethod(F.adaptive_max_pool3d)
