"""normalize, cosine_similarity and pairwise_distance (PyTorch's formulas, written with differentiable Tensor ops)."""
from flame_core.errors import ShapeError, fmt_shape
from flame_core.ops import elementwise as E
from flame_core.ops.shape import broadcast_shapes


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """v / max(||v||_p, eps) for each vector v along `dim`."""
    denom = E.clamp(input.norm(p, dim, keepdim=True), min=eps)
    y = input / denom
    if out is not None:
        return out.copy_(y)
    return y


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """sum(x1 * x2, dim) / (max(||x1||, eps) * max(||x2||, eps)), x1 and x2 broadcast together."""
    try:
        shape = broadcast_shapes(tuple(x1.shape), tuple(x2.shape))
    except Exception:
        raise ShapeError(f"cosine_similarity: x1 {fmt_shape(x1.shape)} and x2 {fmt_shape(x2.shape)} cannot be "
                         f"broadcast together") from None
    if not -len(shape) <= dim < max(len(shape), 1):
        raise IndexError(f"cosine_similarity: dim {dim} out of range for shape {fmt_shape(shape)}")
    a, b = x1.expand(*shape), x2.expand(*shape)
    na = E.clamp(a.norm(2, dim, keepdim=True), min=eps)
    nb = E.clamp(b.norm(2, dim, keepdim=True), min=eps)
    return ((a / na) * (b / nb)).sum(dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """||x1 - x2 + eps||_p along the last dimension (PyTorch adds eps to the difference: no zero norm to
    differentiate), x1 and x2 broadcast together."""
    try:
        shape = broadcast_shapes(tuple(x1.shape), tuple(x2.shape))
    except Exception:
        raise ShapeError(f"pairwise_distance: x1 {fmt_shape(x1.shape)} and x2 {fmt_shape(x2.shape)} cannot be "
                         f"broadcast together") from None
    if not shape:
        raise ShapeError("pairwise_distance: x1 and x2 must have at least one dimension")
    return (x1 - x2 + eps).norm(p, -1, keepdim=keepdim)
