"""Losses with PyTorch's semantics: mse_loss, l1_loss, smooth_l1_loss, huber_loss (targets broadcast against the input
with PyTorch's UserWarning when the sizes differ), binary_cross_entropy(_with_logits), kl_div, nll_loss and
cross_entropy (weights, ignore_index, label smoothing). Computed in float32 for half inputs (autocast's fp32
category). The deprecated size_average / reduce arguments map onto `reduction` as in PyTorch.
"""
import math
import warnings

from flame_core import dtypes as D
from flame_core.amp import autocast_mode as _amp
from flame_core.errors import DTypeError, ShapeError, fmt_shape
from flame_core.ops import elementwise as E
from flame_core.ops import reduction as R
from flame_core.ops.shape import broadcast_shapes

_HALF = (D.float16, D.bfloat16)
_EXP_M100 = math.exp(-100.0)


def _legacy_reduction(size_average, reduce, reduction):
    """PyTorch's mapping of the deprecated flags: reduce=False -> 'none', else size_average -> 'mean' / 'sum'."""
    if size_average is None and reduce is None:
        return reduction
    if isinstance(size_average, str) or isinstance(reduce, str):
        raise TypeError(f"got the string {size_average if isinstance(size_average, str) else reduce!r} for the "
                        f"deprecated size_average / reduce flags: pass reduction= by keyword (PyTorch's third "
                        f"positional argument is size_average)")
    warnings.warn("size_average and reduce args will be deprecated, please use reduction='none'|'mean'|'sum' "
                  "instead.", UserWarning, stacklevel=3)
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if not reduce:
        return "none"
    return "mean" if size_average else "sum"


def _reduce(loss, reduction):
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _pair(op, input, target):
    """input and target broadcast to one shape (PyTorch warns when the sizes differ, then broadcasts)."""
    if tuple(input.shape) != tuple(target.shape):
        try:
            shape = broadcast_shapes(tuple(input.shape), tuple(target.shape))
        except Exception:
            raise ShapeError(f"{op}: input {fmt_shape(input.shape)} and target {fmt_shape(target.shape)} cannot "
                             f"be broadcast to one shape") from None
        warnings.warn(f"Using a target size ({fmt_shape(target.shape)}) that is different to the input size "
                      f"({fmt_shape(input.shape)}). This will likely lead to incorrect results due to broadcasting. "
                      f"Please ensure they have the same size.", UserWarning, stacklevel=3)
        input, target = input.expand(*shape), target.expand(*shape)
    if _amp.active:
        input, target = _amp.cast_inputs("fp32", input, target)
    return input, target


def _weighted(loss, weight, input, reduction):
    """PyTorch's optional per-element weight of mse / l1 / huber: 'mean' divides by the sum of the weights."""
    if weight is None:
        return _reduce(loss, reduction)
    if tuple(weight.shape) != tuple(input.shape):
        raise ValueError(f"Weights and input must have the same size: weight {fmt_shape(weight.shape)}, input "
                         f"{fmt_shape(input.shape)}")
    loss = loss * weight
    if reduction == "mean":
        return loss.sum() / weight.sum()
    return _reduce(loss, reduction)


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    a, b = _pair("mse_loss", input, target)
    d = a - b
    return _weighted(d * d, weight, input, reduction)


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    a, b = _pair("l1_loss", input, target)
    return _weighted((a - b).abs(), weight, input, reduction)


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    """0.5 d^2 / beta where |d| < beta, |d| - 0.5 beta elsewhere (beta = 0: the L1 loss)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if beta < 0:
        raise ValueError(f"smooth_l1_loss does not support negative values for beta, got {beta}")
    a, b = _pair("smooth_l1_loss", input, target)
    d = (a - b).abs()
    if beta == 0:
        return _reduce(d, reduction)
    return _reduce(E.where(d < beta, d * d * (0.5 / beta), d - 0.5 * beta), reduction)


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    """0.5 d^2 where |d| <= delta, delta (|d| - 0.5 delta) elsewhere."""
    if delta <= 0:
        raise ValueError(f"huber_loss: delta must be positive, got {delta}")
    a, b = _pair("huber_loss", input, target)
    d = (a - b).abs()
    loss = E.where(d <= delta, d * d * 0.5, (d - 0.5 * delta) * delta)
    return _weighted(loss, weight, input, reduction)


def _same_size(op, input, target):
    if tuple(input.shape) != tuple(target.shape):
        raise ValueError(f"{op}: using a target size ({fmt_shape(target.shape)}) that is different to the input "
                         f"size ({fmt_shape(input.shape)}) is deprecated. Please ensure they have the same size.")


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """-w (t log x + (1 - t) log(1 - x)) for probabilities x; each log is clamped at -100, as in PyTorch."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _same_size("binary_cross_entropy", input, target)
    if _amp.active:
        input, target, weight = _amp.cast_inputs("fp32", input, target, weight)
    if bool(((input < 0) | (input > 1)).any()):
        raise ValueError("binary_cross_entropy: all elements of input should be between 0 and 1 (probabilities; "
                         "use binary_cross_entropy_with_logits for logits)")
    log_x = E.log(E.clamp(input, min=_EXP_M100))        # log clamped at -100 (without taking log(0))
    log_1mx = E.log(E.clamp(1.0 - input, min=_EXP_M100))
    loss = -(target * log_x + (1.0 - target) * log_1mx)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None, reduction="mean",
                                     pos_weight=None):
    """BCE of sigmoid(x) in the stable form (1 - t) x + (1 + (pw - 1) t) (log1p(exp(-|x|)) + max(-x, 0));
    pos_weight broadcasts along the last (class) dimension."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _same_size("binary_cross_entropy_with_logits", input, target)
    if _amp.active:
        input, target, weight, pos_weight = _amp.cast_inputs("fp32", input, target, weight, pos_weight)
    softplus_neg = E.log1p(E.exp(-input.abs())) + E.relu(-input)  # log(1 + exp(-x)) = -log sigmoid(x)
    if pos_weight is not None:
        loss = (1.0 - target) * input + (1.0 + (pos_weight - 1.0) * target) * softplus_neg
    else:
        loss = (1.0 - target) * input + softplus_neg
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """Pointwise KL divergence t (log t - x) for log-probabilities x (log_target: exp(t) (t - x)); 0 where t = 0.
    'batchmean' divides the sum by the batch size (the mathematical KL); 'mean' by the element count, with
    PyTorch's warning."""
    if size_average is not None or reduce is not None:
        reduction = _legacy_reduction(size_average, reduce, reduction)
    elif reduction == "mean":
        warnings.warn("reduction: 'mean' divides the total loss by both the batch size and the support size."
                      "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
                      "'mean' will be changed to behave the same as 'batchmean' in the next major release.",
                      UserWarning, stacklevel=2)
    if _amp.active:
        input, target = _amp.cast_inputs("fp32", input, target)
    if log_target:
        loss = E.exp(target) * (target - input)
    else:
        positive = target > 0
        safe = E.where(positive, target, 1.0)  # log(1) = 0: no -inf * 0 in the value or the gradient
        loss = E.where(positive, target * (E.log(safe) - input), 0.0)
    if reduction == "batchmean":
        if input.ndim == 0:
            return loss.sum()
        return loss.sum() / input.shape[0]
    return _reduce(loss, reduction)


def _class_dim_last(x):
    """(N, C, d1, ...) -> (N*d1*..., C); (N, C) unchanged; (C,) -> (1, C)."""
    if x.ndim == 1:
        return x.unsqueeze(0)
    if x.ndim == 2:
        return x
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    """Negative log-likelihood of class indices `target` under log-probabilities `input` (N, C, ...)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if target.dtype.is_floating_point:
        raise DTypeError(f"nll_loss: target must hold class indices (integer), got {target.dtype}")
    C = input.shape[1] if input.ndim > 1 else input.shape[0]
    expect = (input.shape[0],) + tuple(input.shape[2:]) if input.ndim > 1 else ()
    if tuple(target.shape) != expect:
        raise ShapeError(f"nll_loss: target {fmt_shape(target.shape)} does not match input {fmt_shape(input.shape)} "
                         f"(expected {fmt_shape(expect)})")
    logp = _class_dim_last(input)                       # (M, C)
    t = target.reshape(-1).long()                       # (M,)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= C))
    if bool(bad.any()):
        raise IndexError(f"nll_loss: target values must be in [0, {C}) or ignore_index={ignore_index}")
    safe = t.masked_fill(~valid, 0)
    picked = -logp.gather(1, safe.unsqueeze(1)).squeeze(1)          # (M,)
    w = valid.to(picked.dtype)
    if weight is not None:
        w = w * weight.to(picked.dtype)[safe]
    loss = picked * w
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / w.sum()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0):
    """Softmax cross-entropy of logits `input` (N, C, ...) against class indices (N, ...) or class probabilities
    (same shape as input)."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if _amp.active:
        input, weight = _amp.cast_inputs("fp32", input, weight)
    if input.dtype in _HALF:
        input = input.float()
    cdim = 1 if input.ndim > 1 else 0
    C = input.shape[cdim]
    logp = R.log_softmax(input, cdim)
    wshape = [1] * input.ndim
    wshape[cdim] = C
    if target.dtype.is_floating_point:  # class probabilities
        if tuple(target.shape) != tuple(input.shape):
            raise ShapeError(f"cross_entropy: probability target {fmt_shape(target.shape)} must match input "
                             f"{fmt_shape(input.shape)}")
        t = target.to(logp.dtype)
        if label_smoothing:
            t = t * (1 - label_smoothing) + label_smoothing / C
        terms = logp * t
        if weight is not None:
            terms = terms * weight.to(logp.dtype).reshape(wshape)
        loss = -terms.sum(cdim)
        if reduction == "mean":
            n = loss.numel()
            return loss.sum() / n
        return _reduce(loss, reduction)
    nll = nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)
    if not label_smoothing:
        return nll
    # PyTorch: (1 - eps) * nll + eps / C * smooth, smooth = -sum_c w_c logp_c over non-ignored samples
    terms = logp if weight is None else logp * weight.to(logp.dtype).reshape(wshape)
    smooth = -terms.sum(cdim)
    valid = (target != ignore_index)
    smooth = smooth * valid.to(smooth.dtype)
    if reduction == "mean":
        if weight is not None:
            denom = (weight.to(logp.dtype)[target.long().masked_fill(~valid, 0)] * valid.to(logp.dtype)).sum()
        else:
            denom = valid.sum().to(logp.dtype)
        smooth = smooth.sum() / denom
    else:
        smooth = _reduce(smooth, reduction)
    return nll * (1 - label_smoothing) + smooth * (label_smoothing / C)
