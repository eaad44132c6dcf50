"""Dirichlet(concentration) over the last dimension, as torch.distributions.Dirichlet; draws as normalised Gamma
draws (no reparameterized sample: rsample raises)."""
from ..autograd.grad_mode import no_grad
from ..ops.math_ops import xlogy
from ..ops.special_fns import digamma, lgamma
from .distribution import Distribution, broadcast_all
from .gamma import standard_gamma


class Dirichlet(Distribution):
    def __init__(self, concentration, validate_args=None):
        (self.concentration,) = broadcast_all(concentration)
        if self.concentration.ndim < 1:
            raise ValueError("Dirichlet: concentration must be at least one-dimensional")
        super().__init__(self.concentration.shape[:-1], self.concentration.shape[-1:], validate_args)
        self._check_param("concentration", self.concentration > 0, "IndependentConstraint(GreaterThan("
                                                                   "lower_bound=0.0), 1)")

    @property
    def mean(self):
        return self.concentration / self.concentration.sum(-1, keepdim=True)

    @property
    def mode(self):
        c = (self.concentration - 1).clamp(min=0.0)
        return c / c.sum(-1, keepdim=True)

    @property
    def variance(self):
        c0 = self.concentration.sum(-1, keepdim=True)
        return self.concentration * (c0 - self.concentration) / (c0.pow(2) * (c0 + 1))

    def sample(self, sample_shape=()):
        with no_grad():
            g = standard_gamma(self.concentration, self._extended_shape(sample_shape))
            return g / g.sum(-1, keepdim=True)

    def log_prob(self, value):
        value = self._value(value)
        self._check_value((value >= 0).all(-1) & ((value.sum(-1) - 1).abs() < 1e-6), "Simplex()")
        c = self.concentration
        return xlogy(c - 1.0, value).sum(-1) + lgamma(c.sum(-1)) - lgamma(c).sum(-1)

    def entropy(self):
        c = self.concentration
        k = c.shape[-1]
        c0 = c.sum(-1)
        return (lgamma(c).sum(-1) - lgamma(c0) - (k - c0) * digamma(c0) - ((c - 1.0) * digamma(c)).sum(-1))
