"""DoRA (PEFT's definition): W' = m ⊙ (W + s·BA) / ‖W + s·BA‖_row with the norm DETACHED from the gradient.

m (out,) starts at the base rows' norms, so W' = W at init (B = 0). The forward never forms W' for the matmul:
    y = Wx + b + (m/‖·‖ − 1)·Wx + (m/‖·‖)·s·B·A·x
where ‖·‖ is recomputed each call (one (out, in) float32 temporary, no gradient), as PEFT does. With dropout in
training, Wx is recomputed on the dropped-out input, again as PEFT.

Files: kohya/LyCORIS `dora_scale` (out, 1) = m; PEFT `lora_magnitude_vector` (out,) = m.
"""
import flame_core as flame
from flame_core.autograd import no_grad

from .. import functional as F
from ..parameter import Parameter
from .layer import adapter_input, autocast_on, wide
from .lora import LoRA


def row_norms(w):
    """‖W‖ per output row, float32 (float64 stays float64)."""
    w = wide(w)
    return (w * w).sum(dim=1).sqrt()


class DoRA(LoRA):
    kind = "dora"
    needs_base = True

    def __init__(self, in_features, out_features, rank=16, alpha=None, dropout=0.0, rslora=False, *,
                 base_weight, init_weights="kaiming", device=None, dtype=flame.float32, generator=None,
                 rank_dropout=0.0, module_dropout=0.0):
        super().__init__(in_features, out_features, rank, alpha, dropout, rslora, init_weights=init_weights,
                         device=device, dtype=dtype, generator=generator, rank_dropout=rank_dropout,
                         module_dropout=module_dropout)
        with no_grad():
            m = row_norms(base_weight.detach()).to(dtype)
        self.magnitude = Parameter(m)

    def _norm(self, weight_rows):
        with no_grad():
            w = wide(weight_rows)
            return row_norms(w + (self.lora_B @ self.lora_A).to(w.dtype) * self.scale)

    def delta(self, x, base_rows=None, weight_rows=None):
        c = self.magnitude / self._norm(weight_rows).to(self.magnitude.dtype)       # (out,)
        xin = adapter_input(x, self.lora_A)
        if self.dropout and self.training:  # PEFT: the base term sees the same dropped-out input
            xin = F.dropout(xin, self.dropout)
            base_rows = F.linear(xin, weight_rows if autocast_on(x) else weight_rows.to(xin.dtype))
        h = self._dropouts(F.linear(xin, self.lora_A) * self.scale, module=False)
        lora = F.linear(h, self.lora_B)                                              # (..., out)
        c = c.to(lora.dtype)
        out = (c - 1) * base_rows.to(lora.dtype) + c * lora
        if self.training and self.module_dropout:   # skipped: the magnitude's term goes too
            out = out * self._module_keep(out)
        return out

    def merged_weight(self, weight_rows):
        with no_grad():
            w = wide(weight_rows)
            v = w + self.delta_weight().to(w.dtype)
            return v * (self.magnitude.to(w.dtype) / row_norms(v)).reshape(-1, 1)

    def to_part(self, rows=None):
        p = super().to_part(rows)
        p.kind = "dora"
        p.tensors["dora_scale"] = self._host(self.magnitude).reshape(-1, 1)
        return p

    def load_part(self, part):
        self._check_load(part, {"dora_scale": (self.out_features, 1)})
        LoRA.load_part(self, part)
        self._assign(self.magnitude, part.tensors["dora_scale"].reshape(-1))
