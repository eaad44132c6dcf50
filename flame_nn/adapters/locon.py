"""LoRA on a convolution (LoCon, as kohya's and LyCORIS's LoRA and PEFT's lora.Conv2d do it):

    down A: a conv in -> r with the base's kernel size, stride, padding and dilation      (r, in, kh, kw)
    up   B: a 1x1 conv r -> out                                                           (out, r, 1, 1)
    y += s·B(A(dropout(x)))        ΔW = s·(B[:, :, 0, 0] @ A.reshape(r, -1)).reshape(out, in, kh, kw)

s = α/r (α/√r for rsLoRA). A starts Kaiming-uniform (a = √5) or Gaussian N(0, 1/r), B at zero, as the Linear LoRA.
Files hold the same keys as a Linear LoRA's, with these 4-D shapes (lora_down / lora_A, lora_up / lora_B); a 1x1
convolution's 2-D (r, in) / (out, r) tensors (some tools squeeze them) load too.
"""

import numpy as np

import flame_core as flame

from .. import functional as F
from .formats import AdapterPart
from .layer import adapter_input
from .lora import LoRA


def _pair(v):
    return (int(v), int(v)) if isinstance(v, int) else tuple(int(x) for x in v)


class LoRAConv2d(LoRA):
    """LoRA's hyperparameters, initialisation, scale and file layout (lora.LoRA) with 4-D factors."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, rank=16, alpha=None,
                 dropout=0.0, rslora=False, *, init_weights="kaiming", device=None, dtype=flame.float32,
                 generator=None, rank_dropout=0.0, module_dropout=0.0):
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        super().__init__(in_channels, out_channels, rank, alpha, dropout, rslora, init_weights=init_weights,
                         device=device, dtype=dtype, generator=generator, rank_dropout=rank_dropout,
                         module_dropout=module_dropout)

    def _down_shape(self):
        return (self.rank, self.in_features, *self.kernel_size)

    def _up_shape(self):
        return (self.out_features, self.rank, 1, 1)

    @classmethod
    def for_conv(cls, conv, rank=16, alpha=None, dropout=0.0, rslora=False, **kw):
        """The adapter shaped for the Conv2d `conv`, on its weight's device."""
        kw.setdefault("device", conv.weight.device)
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                   rank, alpha, dropout, rslora, **kw)

    def delta(self, x, base_rows=None, weight_rows=None):
        x = adapter_input(x, self.lora_A)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        h = F.conv2d(x, self.lora_A, None, self.stride, self.padding, self.dilation) * self.scale   # (N, r, H', W')
        return F.conv2d(self._dropouts(h, rank_dim=1), self.lora_B)                           # (N, out, H', W')

    def delta_weight(self):
        r, out = self.rank, self.out_features
        d = self.lora_B.reshape(out, r) @ self.lora_A.reshape(r, -1)
        return d.reshape(out, self.in_features, *self.kernel_size) * self.scale

    def load_part(self, part):
        if self.kernel_size == (1, 1):     # a 1x1 convolution's LoRA may come squeezed to 2-D
            t = dict(part.tensors)
            for k in ("lora_down.weight", "lora_up.weight"):
                if k in t and np.ndim(t[k]) == 2:
                    t[k] = np.asarray(t[k])[:, :, None, None]
            part = AdapterPart(part.kind, t, part.alpha, part.rows)
        super().load_part(part)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, kernel={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, rank={self.rank}, alpha={self.alpha:g}"
                + (", rslora" if self.rslora else "") + (f", dropout={self.dropout}" if self.dropout else ""))
