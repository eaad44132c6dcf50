"""Bernoulli(probs=None, logits=None), torch.distributions' formulas (log_prob and entropy through the logits)."""
from ..ops.sampling import bernoulli
from .distribution import Distribution
from .probs import binary_params


class Bernoulli(Distribution):
    def __init__(self, probs=None, logits=None, validate_args=None):
        _, self.probs, self.logits = binary_params(self, "Bernoulli", probs, logits, validate_args)
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
