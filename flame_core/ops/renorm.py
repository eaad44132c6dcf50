"""torch.renorm: each sub-tensor along `dim` (input.select(dim, i)) whose p-norm exceeds maxnorm scaled down to norm
maxnorm (by maxnorm / (norm + 1e-7), PyTorch's factor); the others unchanged. Differentiable (the norms included)."""
from ..errors import DTypeError
from . import elementwise as E
from .shape import _norm_dim


def renorm(input, p, dim, maxnorm):
    if not input.dtype.is_floating_point:
        raise DTypeError(f"renorm: expected a floating point tensor, got {input.dtype.name}")
    if not p > 0:
        raise ValueError(f"renorm: non-positive norm {p} not supported")
    if maxnorm < 0:
        raise ValueError(f"renorm: expected maxnorm to be >= 0, got {maxnorm}")
    if input.ndim <= 1:
        raise ValueError(f"renorm: input needs at least 2 dimensions, got {input.ndim}")
    d = _norm_dim(dim, input.ndim, "renorm")
    others = tuple(k for k in range(input.ndim) if k != d)
    norm = input.norm(p, dim=others, keepdim=True)
    factor = E.where(norm > maxnorm, maxnorm / (norm + 1e-7), 1.0)
    return input * factor
