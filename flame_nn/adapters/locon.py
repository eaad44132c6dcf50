"""LoRA on a convolution (LoCon, as kohya's and LyCORIS's LoRA and PEFT's lora.Conv2d do it):

    down A: a conv in -> r with the base's kernel size, stride, padding and dilation      (r, in, kh, kw)
    up   B: a 1x1 conv r -> out                                                           (out, r, 1, 1)
    y += s·B(A(dropout(x)))        ΔW = s·(B[:, :, 0, 0] @ A.reshape(r, -1)).reshape(out, in, kh, kw)

s = α/r (α/√r for rsLoRA). A starts Kaiming-uniform (a = √5) or Gaussian N(0, 1/r), B at zero, as the Linear LoRA.
Files hold the same keys as a Linear LoRA's, with these 4-D shapes (lora_down / lora_A, lora_up / lora_B); a 1x1
convolution's 2-D (r, in) / (out, r) tensors (some tools squeeze them) load too.
"""
import math

import numpy as np

import flame_core as flame

from .. import functional as F
from .. import init
from ..parameter import Parameter
from .formats import AdapterPart
from .layer import Adapter, AdapterError, adapter_input


def _pair(v):
    return (int(v), int(v)) if isinstance(v, int) else tuple(int(x) for x in v)


class LoRAConv2d(Adapter):
    kind = "lora"

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, rank=16, alpha=None,
                 dropout=0.0, rslora=False, *, init_weights="kaiming", device=None, dtype=flame.float32,
                 generator=None):
        super().__init__(in_channels, out_channels)
        if rank < 1:
            raise AdapterError(f"LoRA rank must be >= 1, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise AdapterError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        self.rank, self.rslora, self.dropout = int(rank), bool(rslora), float(dropout)
        self.alpha = float(rank if alpha is None else alpha)
        self.lora_A = Parameter(flame.empty(self.rank, self.in_features, *self.kernel_size, device=device,
                                            dtype=dtype))
        self.lora_B = Parameter(flame.zeros(self.out_features, self.rank, 1, 1, device=device, dtype=dtype))
        if init_weights == "kaiming":
            init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        elif init_weights == "gaussian":
            init.normal_(self.lora_A, std=1.0 / self.rank, generator=generator)
        else:
            raise AdapterError(f"init_weights must be 'kaiming' or 'gaussian', got {init_weights!r}")

    @classmethod
    def for_conv(cls, conv, rank=16, alpha=None, dropout=0.0, rslora=False, **kw):
        """The adapter shaped for the Conv2d `conv`, on its weight's device."""
        kw.setdefault("device", conv.weight.device)
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                   rank, alpha, dropout, rslora, **kw)

    @property
    def scale(self):
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def delta(self, x, base_rows=None, weight_rows=None):
        x = adapter_input(x, self.lora_A)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        h = F.conv2d(x, self.lora_A, None, self.stride, self.padding, self.dilation) * self.scale   # (N, r, H', W')
        return F.conv2d(h, self.lora_B)                                                           # (N, out, H', W')

    def delta_weight(self):
        r, out = self.rank, self.out_features
        d = self.lora_B.reshape(out, r) @ self.lora_A.reshape(r, -1)
        return d.reshape(out, self.in_features, *self.kernel_size) * self.scale

    def to_part(self, rows=None):
        t = {"lora_down.weight": self._host(self.lora_A), "lora_up.weight": self._host(self.lora_B)}
        return AdapterPart(self.kind, t, self.scale * self.rank, rows)   # kohya alpha: s = alpha / r

    def load_part(self, part):
        t = dict(part.tensors)
        if self.kernel_size == (1, 1):     # a 1x1 convolution's LoRA may come squeezed to 2-D
            for k in ("lora_down.weight", "lora_up.weight"):
                if k in t and np.ndim(t[k]) == 2:
                    t[k] = np.asarray(t[k])[:, :, None, None]
        part = AdapterPart(part.kind, t, part.alpha, part.rows)
        self._check_load(part, {"lora_down.weight": (self.rank, self.in_features, *self.kernel_size),
                                "lora_up.weight": (self.out_features, self.rank, 1, 1)})
        self._assign(self.lora_A, t["lora_down.weight"])
        self._assign(self.lora_B, t["lora_up.weight"])
        self.alpha = part.scale * (math.sqrt(self.rank) if self.rslora else self.rank)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, kernel={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, rank={self.rank}, alpha={self.alpha:g}"
                + (", rslora" if self.rslora else "") + (f", dropout={self.dropout}" if self.dropout else ""))
