"""Max-norm regularisation of LoRA adapters (kohya's --scale_weight_norms, networks/lora.py
apply_max_norm_regularization): after each optimizer step, every LoRA / LoCon adapter whose ΔW = s·B·A has a
Frobenius norm above `max_norm` gets A and B scaled by sqrt(max_norm / ‖ΔW‖) each, so ‖ΔW‖ becomes max_norm.

    reg = MaxNorm(adapters, max_norm=1.0)     # adapters: LoRA / LoRAConv2d modules (adapter_modules' third items)
    optimizer.step(); reg.apply()             # the norms stay on the device
    keys_scaled, average_norm, max_norm = reg.stats()    # kohya's three figures, read when logged (a sync)

‖s·B·A‖_F is computed from the two r×r Gram matrices, ‖BA‖² = Σ (BᵀB) ⊙ (AAᵀ), never forming the (out, in) ΔW that
kohya's up @ down materialises (a convolution's A read as (r, in·kh·kw): the same ΔW norm). As in kohya: the norm is
floored at max_norm / 2 before the ratio (a tiny norm scales by 1), an adapter counts as scaled when its ratio is
below 1, and the reported norms are the norms after scaling. Every operation queues on the device (no host sync),
so on cuda `apply` can replay as a CUDA graph (flame_core.cuda.graphed).
"""
import flame_core as flame
from flame_core.autograd import no_grad

from .layer import AdapterError
from .lora import LoRA


class MaxNorm:
    def __init__(self, adapters, max_norm):
        adapters = list(adapters)
        if not max_norm > 0:
            raise AdapterError(f"MaxNorm: max_norm must be > 0, got {max_norm}")
        bad = [type(ad).__name__ for ad in adapters if not isinstance(ad, LoRA) or ad.kind != "lora"]
        if bad:
            raise AdapterError(f"MaxNorm: max-norm regularisation scales LoRA / LoCon adapters (kohya's); got "
                               f"{sorted(set(bad))}")
        if not adapters:
            raise AdapterError("MaxNorm: no adapters")
        self.adapters, self.max_norm = adapters, float(max_norm)
        self._last = None   # (keys scaled, mean norm, max norm) of the last apply, as device tensors

    @no_grad()
    def apply(self):
        """Scale the adapters whose ΔW norm exceeds max_norm (in place); keep the step's figures on the device."""
        m = self.max_norm
        norms = []
        for ad in self.adapters:
            a = ad.lora_A.reshape(ad.rank, -1)
            b = ad.lora_B.reshape(ad.lora_B.shape[0], ad.rank)
            n2 = ((b.t() @ b) * (a @ a.t())).sum().clamp(min=0.0)
            norms.append(n2.sqrt() * abs(ad.scale))
        norm = flame.stack(norms)
        floored = norm.clamp(min=m / 2)
        ratio = floored.clamp(max=m) / floored
        root = ratio.sqrt()
        for i, ad in enumerate(self.adapters):
            r = root[i]
            ad.lora_A.mul_(r.to(ad.lora_A.dtype))
            ad.lora_B.mul_(r.to(ad.lora_B.dtype))
        scaled = norm * ratio
        self._last = ((ratio < 1.0).sum(), scaled.mean(), scaled.max())

    def stats(self):
        """(adapters scaled, their mean norm, the largest norm) after the last apply, as Python numbers; None before
        the first. Reads the device (a synchronisation): for log rows."""
        if self._last is None:
            return None
        k, mean, top = flame.stack([self._last[0].to(self._last[1].dtype), *self._last[1:]]).cpu().numpy()  # one read
        return int(k), float(mean), float(top)
