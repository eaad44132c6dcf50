"""Categorical(probs=None, logits=None) over the last dimension, torch.distributions' formulas: probs normalised to
sum 1, logits to log-probabilities (logits - logsumexp)."""
from ..ops.reduction import logsumexp
from ..ops.sampling import multinomial
from .distribution import Distribution, broadcast_all, finfo
from .probs import logits_to_probs, probs_to_logits


class Categorical(Distribution):
    def __init__(self, probs=None, logits=None, validate_args=None):
        if (probs is None) == (logits is None):
            raise ValueError("Categorical: pass either probs or logits, not both (and not neither)")
        self._validate = self._validate_default if validate_args is None else bool(validate_args)
        t = probs if probs is not None else logits
        (t,) = broadcast_all(t)
        if t.ndim < 1:
            raise ValueError("Categorical: probs / logits need at least one dimension (the categories)")
        if probs is not None:
            self._check_param("probs", t >= 0, "Simplex() (non-negative, summing to a positive number)")
            self.probs = t / t.sum(-1, keepdim=True)
            self.logits = probs_to_logits(self.probs)
        else:
            self.logits = t - logsumexp(t, -1, keepdim=True)
            self.probs = logits_to_probs(self.logits)
        self._num_events = t.shape[-1]
        super().__init__(t.shape[:-1], (), validate_args)

    @property
    def param_shape(self):
        return self.probs.shape

    @property
    def mean(self):
        return self.probs.sum(-1) * float("nan")

    @property
    def mode(self):
        return self.probs.argmax(-1)

    @property
    def variance(self):
        return self.probs.sum(-1) * float("nan")

    def sample(self, sample_shape=()):
        from ..autograd.grad_mode import no_grad
        if isinstance(sample_shape, int):
            sample_shape = (sample_shape,)
        n = 1
        for s in sample_shape:
            n *= int(s)
        with no_grad():
            p2 = self.probs.reshape(-1, self._num_events)
            draws = multinomial(p2, n, replacement=True)            # (batch, n)
            out = draws.T.reshape(tuple(sample_shape) + tuple(self.batch_shape))
        return out

    def log_prob(self, value):
        from .. import broadcast_tensors
        value = self._value(value).long()
        self._check_value((value >= 0) & (value < self._num_events), f"IntegerInterval(0, {self._num_events - 1})")
        v, lp = broadcast_tensors(value.unsqueeze(-1), self.logits)
        return lp.gather(-1, v[..., :1]).squeeze(-1)

    def entropy(self):
        logits = self.logits.clamp(min=float(finfo(self.logits.dtype).min))
        return -(logits * self.probs).sum(-1)

    def enumerate_support(self, expand=True):
        from ..ops.creation import arange
        values = arange(self._num_events, device=self.probs.device).reshape((-1,) + (1,) * len(self.batch_shape))
        return values.expand(-1, *self.batch_shape) if expand else values
