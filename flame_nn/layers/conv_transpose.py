"""ConvTranspose2d: the adjoint of Conv2d (flame_core.ops.conv_transpose), PyTorch's parameters and init."""
from flame_core.errors import ShapeError

from .. import functional as F
from .conv import _ConvNd, _pair


class ConvTranspose2d(_ConvNd):
    """weight (in_channels, out_channels / groups, kH, kW), as PyTorch's."""

    _transposed = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None):
        op, st, dl = _pair(output_padding), _pair(stride), _pair(dilation)
        if any(o >= max(s, d) for o, s, d in zip(op, st, dl)):
            raise ValueError(f"ConvTranspose2d: output_padding {op} must be smaller than either stride {st} or "
                             f"dilation {dl}")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                         device, dtype)
        self.output_padding = op

    def _check_padding(self, padding, padding_mode):
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for ConvTranspose2d, got {padding_mode!r}')

    def _output_padding(self, input, output_size):
        """The output_padding that gives `output_size` (PyTorch's rule: between the smallest size and stride - 1
        more)."""
        if output_size is None:
            return self.output_padding
        size = tuple(int(s) for s in output_size)
        if len(size) == input.ndim:
            size = size[-2:]
        if len(size) != 2:
            raise ValueError(f"ConvTranspose2d: output_size must have 2 or {input.ndim} elements, got {output_size}")
        pads = []
        for d in range(2):
            n = input.shape[input.ndim - 2 + d]
            lo = (n - 1) * self.stride[d] - 2 * self.padding[d] + self.dilation[d] * (self.kernel_size[d] - 1) + 1
            hi = lo + self.stride[d] - 1
            if not lo <= size[d] <= hi:
                raise ShapeError(f"ConvTranspose2d: requested output size {size} is not between {lo} and {hi} along "
                                 f"spatial dim {d} for input {tuple(input.shape)}")
            pads.append(size[d] - lo)
        return tuple(pads)

    def forward(self, input, output_size=None):
        op = self._output_padding(input, output_size)
        return F.conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, op, self.groups,
                                  self.dilation)
