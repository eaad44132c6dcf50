"""Gumbel(loc, scale) and Weibull(scale, concentration), torch.distributions' formulas; draws by inverting the cdf
of a uniform draw (reparameterized)."""
import math

from ..ops.creation import rand
from ..ops.special_fns import lgamma
from .distribution import Distribution, broadcast_all, finfo
from .loc_scale import LocScale

_EULER = 0.57721566490153286061


def _open_uniform(d, shape, like):
    """Uniform draws in (0, 1) (clamped away from both ends by the dtype's tiny and eps)."""
    u = rand(*shape, dtype=like.dtype, device=like.device)
    fi = finfo(like.dtype)
    return u.clamp(float(fi.tiny), 1 - float(fi.eps))


class Gumbel(LocScale):
    @property
    def mean(self):
        return self.loc + self.scale * _EULER

    @property
    def stddev(self):
        return (math.pi / math.sqrt(6)) * self.scale

    @property
    def variance(self):
        return self.stddev.pow(2)

    def rsample(self, sample_shape=()):
        return self.icdf(_open_uniform(self, self._extended_shape(sample_shape), self.loc))

    def log_prob(self, value):
        z = (self._value(value) - self.loc) / self.scale
        return -(z + (-z).exp()) - self.scale.log()

    def cdf(self, value):
        return (-(-(self._value(value) - self.loc) / self.scale).exp()).exp()

    def icdf(self, value):
        return self.loc - self.scale * (-self._value(value).log()).log()

    def entropy(self):
        return self.scale.log() + (1 + _EULER)


class Weibull(Distribution):
    has_rsample = True

    def __init__(self, scale, concentration, validate_args=None):
        self.scale, self.concentration = broadcast_all(scale, concentration)
        super().__init__(self.scale.shape, (), validate_args)
        self._check_param("scale", self.scale > 0, "GreaterThan(lower_bound=0.0)")
        self._check_param("concentration", self.concentration > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        return self.scale * lgamma(1 + self.concentration.reciprocal()).exp()

    @property
    def mode(self):
        k = self.concentration
        return self.scale * ((k - 1) / k).clamp(min=0) ** k.reciprocal()

    @property
    def variance(self):
        k = self.concentration
        return self.scale.pow(2) * (lgamma(1 + 2 / k).exp() - (2 * lgamma(1 + 1 / k)).exp())

    def rsample(self, sample_shape=()):
        u = _open_uniform(self, self._extended_shape(sample_shape), self.scale)
        return self.scale * (-(-u).log1p()) ** self.concentration.reciprocal()

    def log_prob(self, value):
        value = self._value(value)
        self._check_value(value >= 0, "GreaterThanEq(lower_bound=0.0)")
        k, lam = self.concentration, self.scale
        z = value / lam
        return (k / lam).log() + (k - 1) * z.log() - z.pow(k)

    def cdf(self, value):
        return 1 - (-(self._value(value) / self.scale).pow(self.concentration)).exp()

    def icdf(self, value):
        return self.scale * (-(-self._value(value)).log1p()) ** self.concentration.reciprocal()

    def entropy(self):
        k = self.concentration
        return _EULER * (1 - k.reciprocal()) + (self.scale / k).log() + 1
