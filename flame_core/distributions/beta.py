"""Beta(concentration1, concentration0), torch.distributions' formulas (its log_prob is the two-category
Dirichlet's); draws as X / (X + Y) of two Gamma draws. No reparameterized sample (rsample raises)."""
from ..autograd.grad_mode import no_grad
from ..ops.math_ops import xlogy
from ..ops.special_fns import digamma, lgamma
from .distribution import Distribution, broadcast_all
from .gamma import standard_gamma


class Beta(Distribution):
    def __init__(self, concentration1, concentration0, validate_args=None):
        self.concentration1, self.concentration0 = broadcast_all(concentration1, concentration0)
        super().__init__(self.concentration1.shape, (), validate_args)
        self._check_param("concentration1", self.concentration1 > 0, "GreaterThan(lower_bound=0.0)")
        self._check_param("concentration0", self.concentration0 > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        return self.concentration1 / (self.concentration1 + self.concentration0)

    @property
    def mode(self):
        return (self.concentration1 - 1) / (self.concentration1 + self.concentration0 - 2)

    @property
    def variance(self):
        total = self.concentration1 + self.concentration0
        return self.concentration1 * self.concentration0 / (total.pow(2) * (total + 1))

    def sample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        with no_grad():
            x = standard_gamma(self.concentration1, shape)
            y = standard_gamma(self.concentration0, shape)
            return x / (x + y)

    def _lbeta(self):
        a, b = self.concentration1, self.concentration0
        return lgamma(a) + lgamma(b) - lgamma(a + b)

    def log_prob(self, value):
        value = self._value(value)
        self._check_value((value >= 0) & (value <= 1), "Interval(lower_bound=0.0, upper_bound=1.0)")
        return (xlogy(self.concentration1 - 1, value) + xlogy(self.concentration0 - 1, 1 - value)
                - self._lbeta())

    def entropy(self):
        a, b = self.concentration1, self.concentration0
        t = a + b
        return self._lbeta() - (a - 1) * digamma(a) - (b - 1) * digamma(b) + (t - 2) * digamma(t)
