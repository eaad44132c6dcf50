"""LoRA: ΔW = s·B·A with A "down" (r, in) and B "up" (out, r); s = α/r, or α/√r for rsLoRA.

A starts Kaiming-uniform (a = √5, PEFT's and kohya's default) or Gaussian N(0, 1/r) (PEFT's "gaussian"), B starts at
zero, so the adapted model starts as the base. Forward: y += s·B·(A·dropout(x)), computed as two thin matmuls (never
forming ΔW), scaling the rank-r intermediate.

kohya's two other dropouts (networks/lora.py), in training only: rank_dropout p zeroes each rank of the intermediate
per sample (a mask (N, 1, ..., r) -- (N, r, 1, 1) for a convolution's), the kept ones scaled by 1/(1-p) ("as if the
rank were changed"); module_dropout p skips the whole adapter for the step with probability p (one draw per call; no
rescale). Their masks are drawn with flame.rand from the default generator of the input's device.
"""
import math

import flame_core as flame
from flame_core.autograd import no_grad

from .. import functional as F
from .. import init
from ..parameter import Parameter
from .formats import AdapterPart
from .layer import Adapter, AdapterError, adapter_input


class LoRA(Adapter):
    kind = "lora"

    def __init__(self, in_features, out_features, rank=16, alpha=None, dropout=0.0, rslora=False, *,
                 init_weights="kaiming", device=None, dtype=flame.float32, generator=None, rank_dropout=0.0,
                 module_dropout=0.0):
        super().__init__(in_features, out_features)
        if rank < 1:
            raise AdapterError(f"LoRA rank must be >= 1, got {rank}")
        for name, p in (("dropout", dropout), ("rank_dropout", rank_dropout), ("module_dropout", module_dropout)):
            if not 0.0 <= p < 1.0:
                raise AdapterError(f"LoRA {name} must be in [0, 1), got {p}")
        self.rank, self.rslora, self.dropout = int(rank), bool(rslora), float(dropout)
        self.rank_dropout, self.module_dropout = float(rank_dropout), float(module_dropout)
        self.alpha = float(rank if alpha is None else alpha)
        self.lora_A = Parameter(flame.empty(*self._down_shape(), device=device, dtype=dtype))
        self.lora_B = Parameter(flame.zeros(*self._up_shape(), device=device, dtype=dtype))
        if init_weights == "kaiming":
            init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        elif init_weights == "gaussian":
            init.normal_(self.lora_A, std=1.0 / self.rank, generator=generator)
        else:
            raise AdapterError(f"init_weights must be 'kaiming' or 'gaussian', got {init_weights!r}")

    def _down_shape(self):
        return (self.rank, self.in_features)

    def _up_shape(self):
        return (self.out_features, self.rank)

    @property
    def scale(self):
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def _down(self, x):
        x = adapter_input(x, self.lora_A)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return self._dropouts(F.linear(x, self.lora_A) * self.scale)             # (..., r)

    def _module_keep(self, like):
        """module_dropout's draw for this call: 0 (skip the adapter) or 1, in `like`'s dtype and on its device."""
        with no_grad():
            return (flame.rand(1, device=like.device) >= self.module_dropout).to(like.dtype)

    def _dropouts(self, h, rank_dim=-1, module=True):
        """h (the rank-r intermediate, ranks on `rank_dim`) times kohya's training dropouts: rank_dropout's
        per-sample mask of the ranks (scaled by 1/(1-p)) and, with `module`, module_dropout's 0 or 1 for the whole
        adapter."""
        module = module and self.module_dropout
        if not self.training or not (self.rank_dropout or module):
            return h
        f = None
        if self.rank_dropout:
            shape = [1] * h.ndim
            shape[0], shape[rank_dim] = h.shape[0], self.rank
            with no_grad():
                f = (flame.rand(*shape, device=h.device) >= self.rank_dropout).to(h.dtype) * (
                    1.0 / (1.0 - self.rank_dropout))
        if module:
            keep = self._module_keep(h)
            f = keep if f is None else f * keep
        return h * f

    def delta(self, x, base_rows=None, weight_rows=None):
        return F.linear(self._down(x), self.lora_B)               # (..., out)

    def delta_weight(self):
        return (self.lora_B @ self.lora_A) * self.scale

    def to_part(self, rows=None):
        t = {"lora_down.weight": self._host(self.lora_A), "lora_up.weight": self._host(self.lora_B)}
        return AdapterPart(self.kind, t, self.scale * self.rank, rows)   # kohya alpha: s = alpha / r

    def load_part(self, part):
        self._check_load(part, {"lora_down.weight": self._down_shape(), "lora_up.weight": self._up_shape()})
        self._assign(self.lora_A, part.tensors["lora_down.weight"])
        self._assign(self.lora_B, part.tensors["lora_up.weight"])
        s = part.scale
        self.alpha = s * (math.sqrt(self.rank) if self.rslora else self.rank)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"
                + (", rslora" if self.rslora else "") + (f", dropout={self.dropout}" if self.dropout else "")
                + (f", rank_dropout={self.rank_dropout}" if self.rank_dropout else "")
                + (f", module_dropout={self.module_dropout}" if self.module_dropout else ""))
