"""Smaller PyTorch functionals, composed of differentiable ops: pdist, channel_shuffle, lp_pool1d / 2d / 3d,
local_response_norm and gumbel_softmax, with PyTorch's formulas and argument rules."""
import flame_core as flame
from flame_core.errors import ShapeError, fmt_shape
from flame_core.ops import elementwise as E
from flame_core.ops import pooling as P
from flame_core.ops.indexing import pad
from flame_core.ops.pooling3d import avg_pool3d


def pdist(input, p=2.0):
    """The p-norm distances between every pair of rows of input (N, M): the upper triangle of cdist(input, input)
    row by row, (N * (N - 1) / 2,), as torch.pdist."""
    if input.ndim != 2:
        raise ShapeError(f"pdist: expected a 2-D input (N, M), got {fmt_shape(input.shape)}")
    if p < 0:
        raise ValueError(f"pdist: p must be non-negative, got {p}")
    n = input.shape[0]
    i, j = flame.triu_indices(n, n, 1, device=input.device)
    diff = input[i] - input[j]
    if p == 0:
        return E.ne(diff, 0).to(input.dtype).sum(-1)
    if p == float("inf"):
        return diff.abs().amax(-1)
    return (diff.abs() ** p).sum(-1) ** (1.0 / p)


def channel_shuffle(input, groups):
    """(N, g * k, *) -> the channels regrouped as (k, g): channel c of group a goes to position c * g + a."""
    if input.ndim < 3:
        raise ShapeError(f"channel_shuffle: expected an input of at least 3 dims (N, C, *), got "
                         f"{fmt_shape(input.shape)}")
    c = input.shape[1]
    if groups <= 0 or c % groups:
        raise ValueError(f"channel_shuffle: groups={groups} must be positive and divide the {c} channels")
    rest = tuple(input.shape[2:])
    x = input.reshape(input.shape[0], groups, c // groups, *rest)
    return x.transpose(1, 2).reshape(input.shape[0], c, *rest)


def lp_pool2d(input, norm_type, kernel_size, stride=None, ceil_mode=False):
    """(sum over each window of x^p)^(1/p), as PyTorch: avg_pool2d of x^p times the window size, then the root (the
    sign of a negative sum kept before the root: sign(s) * relu(|s|)^(1/p))."""
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    out = P.avg_pool2d(input ** norm_type, (kh, kw), stride, 0, ceil_mode)
    return (E.sign(out) * (out.abs().relu())).mul(kh * kw) ** (1.0 / norm_type)


def lp_pool1d(input, norm_type, kernel_size, stride=None, ceil_mode=False):
    k = kernel_size if isinstance(kernel_size, int) else tuple(kernel_size)[0]
    out = P.avg_pool1d(input ** norm_type, k, stride, 0, ceil_mode)
    return (E.sign(out) * (out.abs().relu())).mul(k) ** (1.0 / norm_type)


def lp_pool3d(input, norm_type, kernel_size, stride=None, ceil_mode=False):
    kd, kh, kw = (kernel_size,) * 3 if isinstance(kernel_size, int) else tuple(kernel_size)
    out = avg_pool3d(input ** norm_type, (kd, kh, kw), stride, 0, ceil_mode)
    return (E.sign(out) * (out.abs().relu())).mul(kd * kh * kw) ** (1.0 / norm_type)


def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):
    """x / (k + alpha / size * sum of x^2 over `size` neighbouring channels)^beta (the window centred, zero-padded
    as PyTorch's: size // 2 before, (size - 1) // 2 after)."""
    if input.ndim < 3:
        raise ShapeError(f"local_response_norm: expected an input of at least 3 dims (N, C, *), got "
                         f"{fmt_shape(input.shape)}")
    if input.numel() == 0:
        return input
    n, c = input.shape[:2]
    sq = (input * input).reshape(n, 1, c, -1)                             # (N, 1, C, rest)
    sq = pad(sq, (0, 0, size // 2, (size - 1) // 2))
    div = P.avg_pool2d(sq, (size, 1), stride=1).squeeze(1)                # mean over the channel window
    div = div.reshape(input.shape)
    return input / (div * alpha + k) ** beta


def gumbel_softmax(logits, tau=1.0, hard=False, eps=1e-10, dim=-1, generator=None):
    """softmax((logits + Gumbel noise) / tau) along dim; hard=True returns the one-hot of its argmax with the soft
    sample's gradient (straight-through), as PyTorch's. The noise is -log(Exp(1)) draws from the generator. `eps`
    is PyTorch's deprecated, unused argument (kept for its signature)."""
    u = flame.rand(tuple(logits.shape), dtype=logits.dtype, device=logits.device, generator=generator)
    expo = -E.log(u.clamp(min=1e-20))                                     # Exp(1) draws
    gumbels = -E.log(expo.clamp(min=1e-20))
    y = ((logits + gumbels) / tau).softmax(dim)
    if not hard:
        return y
    index = y.argmax(dim, keepdim=True)
    y_hard = flame.zeros_like(y).scatter(dim, index, 1.0)
    return y_hard - y.detach() + y
