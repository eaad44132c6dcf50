"""The weights outside the streamed blocks (Flux: the embedders and the final layer) stored in fp8 when a budget needs
the room: they stay on the GPU for the whole step, so each byte saved is a byte of the minimum.

Only frozen Linear weights of at least MIN_ELEMENTS elements are converted: the small ones save nothing worth their
rounding, and a model may read its compute dtype from one of them (Flux reads `img_in.weight.dtype`, 64 x 3072).
"""
from ..layers.linear import Linear
from .fp8 import Float8LinearMixin, quantize_linear_weights_

MIN_ELEMENTS = 1 << 20


def outside_fp8_candidates(modules):
    """[(name, Linear, bytes saved)] of the frozen Linear weights in `modules` ({name: module}) that fp8 would halve."""
    out = []
    for prefix, module in modules.items():
        for name, m in module.named_modules():
            if not isinstance(m, Linear) or isinstance(m, Float8LinearMixin):
                continue
            w = m.weight
            if w.requires_grad or w.is_meta or not w.dtype.is_floating_point or w.numel() < MIN_ELEMENTS:
                continue
            if w.dtype.itemsize <= 1:
                continue
            saved = w.numel() * (w.dtype.itemsize - 1) - 4 * w.shape[0]  # fp8 bytes plus one fp32 scale per row
            out.append((f"{prefix}.{name}" if name else prefix, m, saved))
    return out


def quantize_outside_(modules):
    """Store the candidates' weights as fp8 (flame_nn.offload.fp8). Returns (names, bytes saved)."""
    found = outside_fp8_candidates(modules)
    for _, m, _ in found:
        quantize_linear_weights_(m)
    return [n for n, _, _ in found], sum(s for _, _, s in found)
