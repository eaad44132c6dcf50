"""Conv2d (im2col + GEMM, see flame_core/ops/conv/), Conv1d (the same convolution over a height of one) and Conv3d
(2-D convolutions per depth tap, flame_nn.functional.conv3d), with their base _ConvNd (the transposed ones' too)."""
import math

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module


def _single(v):
    return (v,) if isinstance(v, int) else tuple(v)


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _triple(v):
    return (v, v, v) if isinstance(v, int) else tuple(v)


class _ConvNd(Module):
    """What the convolution layers share, as PyTorch's _ConvNd: the argument checks, the weight in PyTorch's layout
    -- (out_channels, in_channels / groups, *kernel_size), or (in_channels, out_channels / groups, *kernel_size)
    for a `_transposed` one -- and bias with PyTorch's default initialisation, and the repr. Its signature is Conv2d's
    and Conv1d's; `_ntuple` makes a size per spatial dim."""
    _ntuple = staticmethod(_pair)
    _transposed = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        name, n = type(self).__name__, self._ntuple
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        self._check_padding(padding, padding_mode)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = n(kernel_size), n(stride)
        self.padding = padding if isinstance(padding, str) and not self._transposed else n(padding)
        self.output_padding, self.dilation = n(0), n(dilation)
        self.groups, self.padding_mode = groups, padding_mode
        channels = (in_channels, out_channels // groups) if self._transposed else (out_channels, in_channels // groups)
        self.weight = new_parameter(channels + self.kernel_size, dtype, device)
        self.bias = new_parameter((out_channels,), dtype, device) if bias else None
        self.reset_parameters()

    def _check_padding(self, padding, padding_mode):
        name = type(self).__name__
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"{name}: padding_mode must be zeros, reflect, replicate or circular, got "
                             f"{padding_mode!r}")
        if isinstance(padding, str) and padding not in ("same", "valid"):
            pair = {2: ", a pair", 3: ", a triple"}.get(len(self._ntuple(0)), "")
            raise ValueError(f"{name}: padding must be an int{pair}, 'same' or 'valid', got {padding!r}")

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = math.prod(self.weight.shape[1:])
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def extra_repr(self):
        zeros, ones = self._ntuple(0), self._ntuple(1)
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != zeros:
            s += f", padding={self.padding}"
        if self.dilation != ones:
            s += f", dilation={self.dilation}"
        if self.output_padding != zeros:
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


class Conv2d(_ConvNd):
    """weight (out_channels, in_channels / groups, kH, kW): PyTorch's layout and default initialisation."""

    def forward(self, input):
        if self.padding_mode != "zeros" and not isinstance(self.padding, str):
            ph, pw = self.padding
            input = F.pad(input, (pw, pw, ph, ph), mode=self.padding_mode)
            return F.conv2d(input, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv1d(_ConvNd):
    """weight (out_channels, in_channels / groups, kernel_size): PyTorch's layout and default initialisation."""
    _ntuple = staticmethod(_single)

    def forward(self, input):
        if self.padding_mode != "zeros" and not isinstance(self.padding, str):
            p = self.padding[0]
            input = F.pad(input, (p, p), mode=self.padding_mode)
            return F.conv1d(input, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv3d(_ConvNd):
    """weight (out_channels, in_channels / groups, kD, kH, kW): PyTorch's layout and default initialisation."""
    _ntuple = staticmethod(_triple)

    def forward(self, input):
        if self.padding_mode != "zeros" and not isinstance(self.padding, str):
            pd, ph, pw = self.padding
            input = F.pad(input, (pw, pw, ph, ph, pd, pd), mode=self.padding_mode)
            return F.conv3d(input, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return F.conv3d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
