"""torch.cdist: p-norm distances between two sets of row vectors, batched with broadcasting, differentiable."""
import numpy as np

from ..errors import DTypeError, ShapeError, fmt_shape
from ..tensor import Tensor, check_same_device

_MODES = ("use_mm_for_euclid_dist_if_necessary", "use_mm_for_euclid_dist", "donot_use_mm_for_euclid_dist")


def _euclid_mm(x1, x2):
    """||a||^2 + ||b||^2 - 2 a.b through one matrix product, clamped at 1e-30 before the root (PyTorch's
    _euclidean_dist: coincident points get distance 1e-15 and gradient 0)."""
    n1 = (x1 * x1).sum(-1, keepdim=True)            # (..., P, 1)
    n2 = (x2 * x2).sum(-1, keepdim=True).mT         # (..., 1, R)
    return (n1 + n2 - 2 * (x1 @ x2.mT)).clamp_min(1e-30).sqrt()


def cdist(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
    """Distances between the rows of x1 (..., P, M) and x2 (..., R, M): (..., P, R), batch dims broadcast.

    p >= 0 (0 counts differing coordinates, inf is the largest difference). For p = 2 the distances come from a
    matrix product when compute_mode asks for it, or by default when P > 25 or R > 25 (as PyTorch); otherwise from
    the differences directly, whose gradient is exactly 0 at coincident points."""
    if not isinstance(x1, Tensor) or not isinstance(x2, Tensor):
        raise TypeError(f"cdist: x1 and x2 must be Tensors, got {type(x1).__name__} and {type(x2).__name__}")
    check_same_device("cdist", x1, x2)
    if x1.ndim < 2 or x2.ndim < 2:
        raise ShapeError(f"cdist: x1 and x2 need at least 2 dims, got {fmt_shape(x1.shape)} and "
                         f"{fmt_shape(x2.shape)}")
    if x1.shape[-1] != x2.shape[-1]:
        raise ShapeError(f"cdist: x1 {fmt_shape(x1.shape)} and x2 {fmt_shape(x2.shape)} must have the same number "
                         f"of columns")
    if not x1.dtype.is_floating_point or x1.dtype != x2.dtype:
        raise DTypeError(f"cdist: x1 and x2 must have the same floating dtype, got {x1.dtype.name} and "
                         f"{x2.dtype.name}")
    try:
        np.broadcast_shapes(tuple(x1.shape[:-2]), tuple(x2.shape[:-2]))
    except ValueError:
        raise ShapeError(f"cdist: batch dims of x1 {fmt_shape(x1.shape)} and x2 {fmt_shape(x2.shape)} do not "
                         f"broadcast") from None
    if isinstance(p, bool) or not isinstance(p, (int, float)) or p < 0 or p != p:
        raise ValueError(f"cdist: p must be a non-negative number, got {p!r}")
    if compute_mode not in _MODES:
        raise ValueError(f"cdist: compute_mode must be one of {_MODES}, got {compute_mode!r}")
    P, R = x1.shape[-2], x2.shape[-2]
    if p == 2 and (compute_mode == "use_mm_for_euclid_dist" or
                   (compute_mode == _MODES[0] and (P > 25 or R > 25))):
        return _euclid_mm(x1, x2)
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)      # (..., P, R, M)
    if p == 0:
        # a count has zero gradient; the zero-valued term keeps the result on the graph, as PyTorch's does
        count = (diff.detach() != 0).to(diff.dtype).sum(-1)
        return count + (diff * 0).sum(-1) if diff.requires_grad else count
    return diff.norm(p=float(p), dim=-1)
