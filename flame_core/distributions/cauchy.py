"""Cauchy(loc, scale), torch.distributions' formulas (mean and variance undefined: NaN / inf as PyTorch)."""
import math

from ..ops.creation import rand
from .loc_scale import LocScale


class Cauchy(LocScale):

    @property
    def mean(self):
        return self.loc * float("nan")

    @property
    def variance(self):
        return self.loc * 0 + math.inf

    def rsample(self, sample_shape=()):
        u = rand(*self._extended_shape(sample_shape), dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + self.scale * ((u - 0.5) * math.pi).tan()   # the icdf of a uniform draw

    def log_prob(self, value):
        z = (self._value(value) - self.loc) / self.scale
        return -math.log(math.pi) - self.scale.log() - (z * z).log1p()

    def cdf(self, value):
        return ((self._value(value) - self.loc) / self.scale).atan() / math.pi + 0.5

    def icdf(self, value):
        return ((self._value(value) - 0.5) * math.pi).tan() * self.scale + self.loc

    def entropy(self):
        return math.log(4 * math.pi) + self.scale.log()
