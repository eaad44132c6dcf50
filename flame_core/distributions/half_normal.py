"""HalfNormal(scale): |X| for X ~ Normal(0, scale), torch.distributions' formulas."""
import math

from .distribution import Distribution, broadcast_all
from .normal import Normal


class HalfNormal(Distribution):
    has_rsample = True

    def __init__(self, scale, validate_args=None):
        (self.scale,) = broadcast_all(scale)
        self.base_dist = Normal(self.scale * 0, self.scale, validate_args)
        super().__init__(self.scale.shape, (), validate_args)

    @property
    def mean(self):
        return self.scale * math.sqrt(2 / math.pi)

    @property
    def mode(self):
        return self.scale * 0

    @property
    def variance(self):
        return self.scale.pow(2) * (1 - 2 / math.pi)

    def rsample(self, sample_shape=()):
        return self.base_dist.rsample(sample_shape).abs()

    def log_prob(self, value):
        value = self._value(value)
        self._check_value(value >= 0, "GreaterThanEq(lower_bound=0.0)")
        return (self.base_dist.log_prob(value) + math.log(2)).masked_fill(value < 0, -math.inf)

    def cdf(self, value):
        return 2 * self.base_dist.cdf(self._value(value)) - 1

    def icdf(self, value):
        return self.base_dist.icdf((self._value(value) + 1) / 2)

    def entropy(self):
        return self.base_dist.entropy() - math.log(2)
