"""Losses: mse_loss, l1_loss, nll_loss, cross_entropy (PyTorch semantics, including weights, ignore_index and
label smoothing). Computed in float32 for half inputs (autocast's fp32 category)."""
from flame_core import dtypes as D
from flame_core.amp import autocast_mode as _amp
from flame_core.errors import DTypeError, ShapeError, fmt_shape
from flame_core.ops import reduction as R

_HALF = (D.float16, D.bfloat16)


def _reduce(loss, reduction):
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _pair_check(op, input, target):
    if tuple(input.shape) != tuple(target.shape):
        raise ShapeError(f"{op}: input {fmt_shape(input.shape)} and target {fmt_shape(target.shape)} must have the "
                         f"same shape")
    if _amp.active:
        input, target = _amp.cast_inputs("fp32", input, target)
    return input, target


def mse_loss(input, target, reduction="mean"):
    input, target = _pair_check("mse_loss", input, target)
    d = input - target
    return _reduce(d * d, reduction)


def l1_loss(input, target, reduction="mean"):
    input, target = _pair_check("l1_loss", input, target)
    return _reduce((input - target).abs(), reduction)


def _class_dim_last(x):
    """(N, C, d1, ...) -> (N*d1*..., C); (N, C) unchanged; (C,) -> (1, C)."""
    if x.ndim == 1:
        return x.unsqueeze(0)
    if x.ndim == 2:
        return x
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def nll_loss(input, target, weight=None, ignore_index=-100, reduction="mean"):
    """Negative log-likelihood of class indices `target` under log-probabilities `input` (N, C, ...)."""
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


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Softmax cross-entropy of logits `input` (N, C, ...) against class indices (N, ...) or class probabilities
    (same shape as input)."""
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
    nll = nll_loss(logp, target, weight, ignore_index, reduction)
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
