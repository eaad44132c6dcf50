"""Bernoulli(probs=None, logits=None), torch.distributions' formulas (log_prob and entropy through the logits)."""
from ..ops.sampling import bernoulli
from .distribution import Distribution, broadcast_all
from .probs import logits_to_probs, probs_to_logits


class Bernoulli(Distribution):
    def __init__(self, probs=None, logits=None, validate_args=None):
        if (probs is None) == (logits is None):
            raise ValueError("Bernoulli: pass either probs or logits, not both (and not neither)")
        self._validate = self._validate_default if validate_args is None else bool(validate_args)
        if probs is not None:
            (self.probs,) = broadcast_all(probs)
            self._check_param("probs", (self.probs >= 0) & (self.probs <= 1), "Interval(lower_bound=0.0, "
                                                                              "upper_bound=1.0)")
            self.logits = probs_to_logits(self.probs, is_binary=True)
        else:
            (self.logits,) = broadcast_all(logits)
            self.probs = logits_to_probs(self.logits, is_binary=True)
        super().__init__(self.probs.shape, (), validate_args)

    @property
    def mean(self):
        return self.probs

    @property
    def mode(self):
        m = (self.probs >= 0.5).to(self.probs.dtype)
        return m.masked_fill(self.probs == 0.5, float("nan"))

    @property
    def variance(self):
        return self.probs * (1 - self.probs)

    def sample(self, sample_shape=()):
        from ..autograd.grad_mode import no_grad
        with no_grad():
            return bernoulli(self.probs.expand(*self._extended_shape(sample_shape)))

    def log_prob(self, value):
        from flame_core.ops.activation import softplus
        value = self._value(value)
        self._check_value((value == 0) | (value == 1), "Boolean()")
        # -BCE with logits: value * logits - softplus(logits)
        return value * self.logits - softplus(self.logits)

    def entropy(self):
        from flame_core.ops.activation import softplus
        return softplus(self.logits) - self.probs * self.logits
