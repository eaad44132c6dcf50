"""F.embedding with PyTorch's whole signature: the lookup of flame_core.ops.embedding plus max_norm (the rows looked
up are renormalised in place first, PyTorch's embedding_renorm_) and scale_grad_by_freq (each row's gradient divided
by how often the input names it). sparse=True is refused: FLAME has no sparse gradients."""
import flame_core as flame
from flame_core.autograd import Function, no_grad
from flame_core.ops.embedding import embedding as _lookup


class ScaleGrad(Function):
    """Identity forward; the gradient times `scale` (scale_grad_by_freq)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def renorm_rows_(weight, idx, max_norm, norm_type):
    """weight's rows at idx with a norm_type-norm above max_norm scaled to max_norm (by max_norm / (norm + 1e-7)),
    in place and outside autograd, as PyTorch's embedding_renorm_."""
    with no_grad():
        flat = idx.reshape(-1)
        rows = weight[flat]
        norms = rows.norm(p=norm_type, dim=1, keepdim=True)
        weight[flat] = rows * flame.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)


def inverse_frequency(input, num, like):
    """1 / (how often each index of input occurs in input), shaped as input + (1,), in like's dtype."""
    freq = flame.bincount(input.reshape(-1).long(), minlength=num)[input]
    return (1.0 / freq.to(like.dtype)).unsqueeze(-1)


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """weight's rows picked by the integer input (input.shape + (embedding_dim,)); the row at padding_idx gets no
    gradient."""
    if sparse:
        raise NotImplementedError("embedding: sparse=True needs sparse gradients, which FLAME does not have")
    if padding_idx is not None:
        n = weight.shape[0]
        if not -n <= padding_idx < n:
            raise ValueError(f"embedding: padding_idx {padding_idx} must be within num_embeddings {n}")
        padding_idx %= n
    if max_norm is not None and input.numel():
        renorm_rows_(weight, input, max_norm, norm_type)
    out = _lookup(input, weight, padding_idx)
    if scale_grad_by_freq and input.numel():
        out = ScaleGrad.apply(out, inverse_frequency(input, weight.shape[0], out))
    return out
