"""PyTorch's ranking, embedding and margin losses and its Poisson / Gaussian negative log-likelihoods:
margin_ranking_loss, hinge_embedding_loss, soft_margin_loss, cosine_embedding_loss, multilabel_soft_margin_loss,
multi_margin_loss, multilabel_margin_loss, triplet_margin_loss, triplet_margin_with_distance_loss, poisson_nll_loss,
gaussian_nll_loss.
Each is PyTorch's formula (its epsilons included) composed of differentiable ops; `reduction` is 'mean', 'sum' or
'none', and the deprecated size_average / reduce flags map onto it as in the other losses."""
import math

from flame_core.errors import DTypeError, ShapeError, fmt_shape
from flame_core.ops import elementwise as E
from flame_core.ops.indexing import one_hot
from flame_core.tensor import Tensor

from .activation import logsigmoid
from .distance import pairwise_distance
from .loss import _legacy_reduction, _reduce


def margin_ranking_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    """max(0, -target * (input1 - input2) + margin): target 1 ranks input1 higher, -1 input2."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if input1.ndim != input2.ndim or input1.ndim != target.ndim:
        raise ShapeError(f"margin_ranking_loss: input1 {fmt_shape(input1.shape)}, input2 {fmt_shape(input2.shape)} "
                         f"and target {fmt_shape(target.shape)} must have the same number of dims")
    return _reduce((-target * (input1 - input2) + margin).clamp(min=0), reduction)


def hinge_embedding_loss(input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"):
    """input where target is 1, max(0, margin - input) where it is -1 (PyTorch: both terms where target is
    neither)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    margin_term = E.where(E.ne(target, 1), (margin - input).clamp(min=0), 0.0)
    self_term = E.where(E.ne(target, -1), input, 0.0)
    return _reduce(margin_term + self_term, reduction)


def soft_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """log(1 + exp(-target * input)) (two-class logistic loss, targets +-1)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    return _reduce(-logsigmoid(target * input), reduction)


def cosine_embedding_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    """1 - cos(x1, x2) where target is 1, max(0, cos(x1, x2) - margin) where it is -1; x (N, D) with target (N,),
    or x (D,) with a 0-d target (PyTorch's epsilon 1e-12 in each squared norm)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if input1.ndim not in (1, 2) or tuple(input1.shape) != tuple(input2.shape):
        raise ShapeError(f"cosine_embedding_loss: inputs {fmt_shape(input1.shape)} and {fmt_shape(input2.shape)} "
                         f"must be (N, D) or (D,) of one shape")
    dim = input1.ndim - 1
    prod = (input1 * input2).sum(dim)
    mag = ((input1 * input1).sum(dim) + 1e-12) * ((input2 * input2).sum(dim) + 1e-12)
    cos = prod / mag.sqrt()
    loss = E.where(E.eq(target, 1), 1 - cos, 0.0) + E.where(E.eq(target, -1), (cos - margin).clamp(min=0), 0.0)
    return _reduce(loss, reduction)


def multilabel_soft_margin_loss(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """-(y log sigmoid(x) + (1 - y) log sigmoid(-x)), (optionally weighted) averaged over the C classes of x (N, C)
    or (C,), then reduced over the samples."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    loss = -(target * logsigmoid(input) + (1 - target) * logsigmoid(-input))
    if weight is not None:
        loss = loss * weight
    loss = loss.sum(-1) / input.shape[-1]
    return _reduce(loss, reduction)


def multi_margin_loss(input, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None,
                      reduction="mean"):
    """Multi-class hinge loss of x (N, C) (or (C,)) and class indices y: sum over j != y of
    max(0, margin - x[y] + x[j])^p / C (each term times weight[y] when given); p is 1 or 2."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if p not in (1, 2):
        raise ValueError(f"multi_margin_loss: only p == 1 and p == 2 supported, got {p}")
    x = input if input.ndim == 2 else input.unsqueeze(0)
    y = target.reshape(-1)
    if x.ndim != 2 or y.shape[0] != x.shape[0]:
        raise ShapeError(f"multi_margin_loss: input {fmt_shape(input.shape)} and target {fmt_shape(target.shape)} "
                         f"do not fit ((N, C) with (N,), or (C,) with a 0-d / 1-element target)")
    C = x.shape[1]
    xy = x.gather(1, y.unsqueeze(1))                                     # (N, 1)
    terms = (margin - xy + x).clamp(min=0)
    if p == 2:
        terms = terms * terms
    if weight is not None:
        terms = terms * weight.gather(0, y).unsqueeze(1)
    not_target = 1 - one_hot(y, C).to(terms.dtype)
    loss = (terms * not_target).sum(1) / C
    if input.ndim == 1:
        loss = loss.reshape(())
    return _reduce(loss, reduction)


def multilabel_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """Multi-label hinge loss of x (N, C) (or (C,)) and target class indices of the same shape, read up to the first
    -1: sum over target classes j and non-target classes i of max(0, 1 - (x[j] - x[i])) / C."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if input.ndim not in (1, 2) or input.numel() == 0 and input.ndim == 1:
        raise ShapeError(f"multilabel_margin_loss: expected a non-empty (C,) or (N, C) input, got "
                         f"{fmt_shape(input.shape)}")
    if tuple(target.shape) != tuple(input.shape):
        raise ShapeError(f"multilabel_margin_loss: inconsistent target size {fmt_shape(target.shape)} for input of "
                         f"size {fmt_shape(input.shape)}")
    if target.dtype.is_floating_point:
        raise DTypeError(f"multilabel_margin_loss: target must hold class indices (int64), got {target.dtype}")
    x, y = (input, target) if input.ndim == 2 else (input.unsqueeze(0), target.unsqueeze(0))
    C = x.shape[1]
    listed = (y != -1).long().cumprod(1).bool()                          # (N, C): the entries before the first -1
    if bool((listed & ((y < 0) | (y >= C))).any()):
        raise IndexError(f"multilabel_margin_loss: target class indices must be in [0, {C}) or -1 to end the list")
    y = y.masked_fill(~listed, 0).long()
    is_target = (one_hot(y, C) * listed.long().unsqueeze(-1)).sum(1) > 0     # (N, C)
    x_target = x.gather(1, y)                                            # (N, C): x at each listed class
    hinge = (1 - x_target.unsqueeze(2) + x.unsqueeze(1)).clamp(min=0)   # (N, j, i)
    pairs = listed.unsqueeze(2) & ~is_target.unsqueeze(1)
    loss = (hinge * pairs.to(hinge.dtype)).sum((1, 2)) / C
    return _reduce(loss if input.ndim == 2 else loss.reshape(()), reduction)


def triplet_margin_with_distance_loss(anchor, positive, negative, *, distance_function=None, margin=1.0,
                                      swap=False, reduction="mean"):
    """max(0, margin + d(anchor, positive) - d(anchor, negative)), d the distance_function (default
    pairwise_distance); swap uses min(d(a, n), d(p, n)) as the negative distance."""
    if margin <= 0:
        raise ValueError(f"triplet_margin_with_distance_loss: margin must be greater than 0, got {margin}")
    d = distance_function if distance_function is not None else pairwise_distance
    d_ap, d_an = d(anchor, positive), d(anchor, negative)
    if swap:
        d_an = E.minimum(d_an, d(positive, negative))
    return _reduce((margin + d_ap - d_an).clamp(min=0), reduction)


def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2, eps=1e-6, swap=False, size_average=None,
                        reduce=None, reduction="mean"):
    """triplet_margin_with_distance_loss with the p-norm pairwise distance (eps added to the differences)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if not (anchor.ndim == positive.ndim == negative.ndim) or anchor.ndim not in (1, 2):
        raise ShapeError(f"triplet_margin_loss: anchor {fmt_shape(anchor.shape)}, positive "
                         f"{fmt_shape(positive.shape)} and negative {fmt_shape(negative.shape)} must all be (N, D) "
                         f"or (D,)")
    return triplet_margin_with_distance_loss(
        anchor, positive, negative, distance_function=lambda a, b: pairwise_distance(a, b, p, eps),
        margin=margin, swap=swap, reduction=reduction)


def poisson_nll_loss(input, target, log_input=True, full=False, size_average=None, eps=1e-8, reduce=None,
                     reduction="mean"):
    """exp(input) - target * input (log_input), or input - target * log(input + eps); `full` adds Stirling's
    approximation target log(target) - target + log(2 pi target) / 2 where target > 1."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if log_input:
        loss = E.exp(input) - target * input
    else:
        loss = input - target * E.log(input + eps)
    if full:
        t = target if isinstance(target, Tensor) else input.new_tensor(target)
        safe = E.where(t > 1, t, 1.0)
        stirling = safe * E.log(safe) - safe + 0.5 * E.log(2 * math.pi * safe)
        loss = loss + E.where(t > 1, stirling, 0.0)
    return _reduce(loss, reduction)


def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """(log(max(var, eps)) + (input - target)^2 / max(var, eps)) / 2 (+ log(2 pi) / 2 with full). var has input's
    shape, one dim fewer (one variance per sample), or a last dim of 1; the clamp at eps passes the gradient through
    unchanged, as PyTorch's (it clamps in place without recording)."""
    if isinstance(var, (int, float)):
        var = input.new_full(tuple(input.shape), float(var))
    if tuple(var.shape) != tuple(input.shape):
        if tuple(input.shape[:-1]) == tuple(var.shape):
            var = var.unsqueeze(-1)
        elif not (tuple(input.shape[:-1]) == tuple(var.shape[:-1]) and var.shape[-1] == 1):
            raise ValueError(f"gaussian_nll_loss: var {fmt_shape(var.shape)} does not fit input "
                             f"{fmt_shape(input.shape)} (same shape, one dim fewer, or a last dim of 1)")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if bool((var < 0).any()):
        raise ValueError("gaussian_nll_loss: var has negative entry/entries")
    var = var + (var.clamp(min=eps) - var).detach()
    loss = 0.5 * (E.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return _reduce(loss, reduction)
