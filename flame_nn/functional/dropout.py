"""dropout: zero each element with probability p and scale the survivors by 1/(1-p) (training only)."""
from flame_core.autograd import no_grad
from flame_core.ops.creation import rand


def dropout(input, p=0.5, training=True, inplace=False, generator=None):
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    with no_grad():
        keep = rand(tuple(input.shape), dtype=input.dtype if input.dtype.itemsize >= 4 else None,
                    device=input.device, generator=generator) >= p
        scale = keep.to(input.dtype) * (0.0 if p == 1.0 else 1.0 / (1.0 - p))
    if inplace:
        return input.mul_(scale)
    return input * scale
