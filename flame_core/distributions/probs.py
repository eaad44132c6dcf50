"""probs <-> logits as torch.distributions.utils: binary (logit of p) or categorical (log p), probs clamped to
[eps, 1 - eps] of their dtype first."""
from ..ops.reduction import softmax
from .distribution import finfo


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
