"""Laplace(loc, scale), torch.distributions' formulas."""
import math

from ..ops.creation import rand
from .distribution import finfo
from .loc_scale import LocScale


class Laplace(LocScale):

    @property
    def stddev(self):
        return math.sqrt(2) * self.scale

    @property
    def variance(self):
        return 2 * self.scale.pow(2)

    def rsample(self, sample_shape=()):
        # u uniform in (-1, 1) (never -1: log1p(-|u|) stays finite), as PyTorch's eps - 1
        eps = float(finfo(self.loc.dtype).eps)
        u = rand(*self._extended_shape(sample_shape), dtype=self.loc.dtype, device=self.loc.device) \
            * (2 - eps) + (eps - 1)
        return self.loc - self.scale * u.sign() * (-u.abs()).log1p()

    def log_prob(self, value):
        value = self._value(value)
        return -(2 * self.scale).log() - (value - self.loc).abs() / self.scale

    def cdf(self, value):
        d = self._value(value) - self.loc
        return 0.5 - 0.5 * d.sign() * (-d.abs() / self.scale).expm1()

    def icdf(self, value):
        term = self._value(value) - 0.5
        return self.loc - self.scale * term.sign() * (-2 * term.abs()).log1p()

    def entropy(self):
        return 1 + (2 * self.scale).log()
