"""Uniform(low, high) on [low, high), torch.distributions' formulas."""
from ..ops.creation import rand
from .distribution import Distribution, broadcast_all


class Uniform(Distribution):
    has_rsample = True

    def __init__(self, low, high, validate_args=None):
        self.low, self.high = broadcast_all(low, high)
        super().__init__(self.low.shape, (), validate_args)
        self._check_param("low", self.low < self.high, "LessThan(high)")

    @property
    def mean(self):
        return (self.high + self.low) / 2

    @property
    def mode(self):
        return self.mean * float("nan")

    @property
    def stddev(self):
        return (self.high - self.low) / 12 ** 0.5

    @property
    def variance(self):
        return (self.high - self.low).pow(2) / 12

    def rsample(self, sample_shape=()):
        u = rand(*self._extended_shape(sample_shape), dtype=self.low.dtype, device=self.low.device)
        return self.low + u * (self.high - self.low)

    def log_prob(self, value):
        value = self._value(value)
        inside = (self.low <= value) & (self.high > value)
        return inside.to(self.low.dtype).log() - (self.high - self.low).log()

    def cdf(self, value):
        value = self._value(value)
        return ((value - self.low) / (self.high - self.low)).clamp(0, 1)

    def icdf(self, value):
        return self.low + self._value(value) * (self.high - self.low)

    def entropy(self):
        return (self.high - self.low).log()
