"""Conv2d (im2col + GEMM, see flame_core/ops/conv.py) and Conv1d (the same convolution over a height of one)."""
import math

from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class Conv2d(Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"Conv2d: padding_mode must be zeros, reflect, replicate or circular, got "
                             f"{padding_mode!r}")
        if isinstance(padding, str) and padding not in ("same", "valid"):
            raise ValueError(f"Conv2d: padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = _pair(kernel_size), _pair(stride)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        self.dilation, self.groups, self.padding_mode = _pair(dilation), groups, padding_mode
        self.weight = new_parameter((out_channels, in_channels // groups) + self.kernel_size, dtype, device)
        self.bias = new_parameter((out_channels,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = (self.in_channels // self.groups) * self.kernel_size[0] * self.kernel_size[1]
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        if self.padding_mode != "zeros" and not isinstance(self.padding, str):
            ph, pw = self.padding
            mode = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}[self.padding_mode]
            input = F.pad(input, (pw, pw, ph, ph), mode=mode)
            return F.conv2d(input, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self):
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding if isinstance(self.padding, str) else self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


def _single(v):
    return (v,) if isinstance(v, int) else tuple(v)


class Conv1d(Module):
    """weight (out_channels, in_channels / groups, kernel_size): PyTorch's layout and default initialisation."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv1d: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"Conv1d: padding_mode must be zeros, reflect, replicate or circular, got "
                             f"{padding_mode!r}")
        if isinstance(padding, str) and padding not in ("same", "valid"):
            raise ValueError(f"Conv1d: padding must be an int, 'same' or 'valid', got {padding!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = _single(kernel_size), _single(stride)
        self.padding = padding if isinstance(padding, str) else _single(padding)
        self.dilation, self.groups, self.padding_mode = _single(dilation), groups, padding_mode
        self.weight = new_parameter((out_channels, in_channels // groups) + self.kernel_size, dtype, device)
        self.bias = new_parameter((out_channels,), dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = (self.in_channels // self.groups) * self.kernel_size[0]
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        if self.padding_mode != "zeros" and not isinstance(self.padding, str):
            p = self.padding[0]
            input = F.pad(input, (p, p), mode=self.padding_mode)
            return F.conv1d(input, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self):
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,):
            s += f", padding={self.padding}"
        if self.dilation != (1,):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s
