"""probs <-> logits as torch.distributions.utils: binary (logit of p) or categorical (log p), probs clamped to
[eps, 1 - eps] of their dtype first."""
from ..ops.reduction import softmax
from .distribution import broadcast_all, finfo


def clamp_probs(probs):
    eps = float(finfo(probs.dtype).eps)
    return probs.clamp(eps, 1 - eps)


def probs_to_logits(probs, is_binary=False):
    p = clamp_probs(probs)
    if is_binary:
        return p.log() - (-p).log1p()
    return p.log()


def logits_to_probs(logits, is_binary=False):
    if is_binary:
        return logits.sigmoid()
    return softmax(logits, -1)


def binary_params(dist, name, probs, logits, validate_args, *others):
    """(others broadcast, probs, logits) of a distribution given exactly one of probs / logits of a binary event
    (Bernoulli, Geometric, Binomial, the relaxed Bernoulli): probs checked in [0, 1] under validate_args, the other
    one derived; `others` (e.g. total_count) broadcast with it."""
    if (probs is None) == (logits is None):
        raise ValueError(f"{name}: pass either probs or logits, not both (and not neither)")
    dist._validate = dist._validate_default if validate_args is None else bool(validate_args)   # (for the check)
    if probs is not None:
        *rest, p = broadcast_all(*others, probs)
        dist._check_param("probs", (p >= 0) & (p <= 1), "Interval(lower_bound=0.0, upper_bound=1.0)")
        return rest, p, probs_to_logits(p, is_binary=True)
    *rest, lg = broadcast_all(*others, logits)
    return rest, logits_to_probs(lg, is_binary=True), lg
