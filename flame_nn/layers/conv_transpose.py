"""ConvTranspose1d / 2d / 3d: the adjoints of Conv1d / 2d / 3d (flame_core.ops.conv_transpose and the functional
1-D / 3-D forms built on it), PyTorch's parameters, init and output_size rule."""
from flame_core.errors import ShapeError

from .. import functional as F
from .conv import _ConvNd, _single, _triple


class _ConvTransposeNd(_ConvNd):
    """What the transposed convolutions share: output_padding (checked against stride and dilation), zeros padding
    only, and forward's output_size (PyTorch's rule: between the smallest size and stride - 1 more)."""

    _transposed = True
    _fn = None      # the functional form (set by each class)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None):
        n = self._ntuple
        op, st, dl = n(output_padding), n(stride), n(dilation)
        if any(o >= max(s, d) for o, s, d in zip(op, st, dl)):
            raise ValueError(f"{type(self).__name__}: output_padding {op} must be smaller than either stride {st} "
                             f"or dilation {dl}")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                         device, dtype)
        self.output_padding = op

    def _check_padding(self, padding, padding_mode):
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for {type(self).__name__}, got '
                             f'{padding_mode!r}')

    def _output_padding(self, input, output_size):
        """The output_padding that gives `output_size`."""
        if output_size is None:
            return self.output_padding
        k = len(self.kernel_size)
        name = type(self).__name__
        size = tuple(int(s) for s in output_size)
        if len(size) == input.ndim:
            size = size[-k:]
        if len(size) != k:
            raise ValueError(f"{name}: output_size must have {k} or {input.ndim} elements, got {output_size}")
        pads = []
        for d in range(k):
            n = input.shape[input.ndim - k + d]
            lo = (n - 1) * self.stride[d] - 2 * self.padding[d] + self.dilation[d] * (self.kernel_size[d] - 1) + 1
            hi = lo + self.stride[d] - 1
            if not lo <= size[d] <= hi:
                raise ShapeError(f"{name}: requested output size {size} is not between {lo} and {hi} along "
                                 f"spatial dim {d} for input {tuple(input.shape)}")
            pads.append(size[d] - lo)
        return tuple(pads)

    def forward(self, input, output_size=None):
        op = self._output_padding(input, output_size)
        return type(self)._fn(input, self.weight, self.bias, self.stride, self.padding, op, self.groups,
                              self.dilation)


class ConvTranspose1d(_ConvTransposeNd):
    """weight (in_channels, out_channels / groups, K), as PyTorch's."""
    _ntuple = staticmethod(_single)
    _fn = staticmethod(F.conv_transpose1d)


class ConvTranspose2d(_ConvTransposeNd):
    """weight (in_channels, out_channels / groups, kH, kW), as PyTorch's."""
    _fn = staticmethod(F.conv_transpose2d)


class ConvTranspose3d(_ConvTransposeNd):
    """weight (in_channels, out_channels / groups, kD, kH, kW), as PyTorch's."""
    _ntuple = staticmethod(_triple)
    _fn = staticmethod(F.conv_transpose3d)
