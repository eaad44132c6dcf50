"""ConvTranspose2d: the adjoint of Conv2d (flame_core.ops.conv_transpose), PyTorch's parameters and init."""
import math

from flame_core.errors import ShapeError

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module
from .conv import _pair


class ConvTranspose2d(Module):
    """weight (in_channels, out_channels / groups, kH, kW), as PyTorch's."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"ConvTranspose2d: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for ConvTranspose2d, got {padding_mode!r}')
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = _pair(kernel_size), _pair(stride), _pair(padding)
        self.output_padding, self.dilation = _pair(output_padding), _pair(dilation)
        self.groups, self.padding_mode = groups, padding_mode
        if any(op >= max(s, d) for op, s, d in zip(self.output_padding, self.stride, self.dilation)):
            raise ValueError(f"ConvTranspose2d: output_padding {self.output_padding} must be smaller than either "
                             f"stride {self.stride} or dilation {self.dilation}")
        self.weight = new_parameter((in_channels, out_channels // groups) + self.kernel_size, dtype, device)
        self.bias = new_parameter((out_channels,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = (self.out_channels // self.groups) * self.kernel_size[0] * self.kernel_size[1]
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

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

    def extra_repr(self):
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.output_padding != (0, 0):
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s
