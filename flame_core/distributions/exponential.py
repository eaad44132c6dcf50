"""Exponential(rate), torch.distributions' formulas."""
from ..ops.creation import rand
from .distribution import Distribution, broadcast_all


class Exponential(Distribution):
    has_rsample = True

    def __init__(self, rate, validate_args=None):
        (self.rate,) = broadcast_all(rate)
        super().__init__(self.rate.shape, (), validate_args)
        self._check_param("rate", self.rate > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        return self.rate.reciprocal()

    @property
    def mode(self):
        return self.rate * 0

    @property
    def stddev(self):
        return self.rate.reciprocal()

    @property
    def variance(self):
        return self.rate.pow(-2)

    def rsample(self, sample_shape=()):
        u = rand(*self._extended_shape(sample_shape), dtype=self.rate.dtype, device=self.rate.device)
        return -(-u).log1p() / self.rate   # u in [0, 1): -log(1 - u) is a standard exponential draw

    def log_prob(self, value):
        value = self._value(value)
        self._check_value(value >= 0, "GreaterThanEq(lower_bound=0.0)")
        return self.rate.log() - self.rate * value

    def cdf(self, value):
        return 1 - (-self.rate * self._value(value)).exp()

    def icdf(self, value):
        return -(-self._value(value)).log1p() / self.rate

    def entropy(self):
        return 1.0 - self.rate.log()
