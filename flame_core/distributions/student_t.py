"""StudentT(df, loc=0, scale=1) and Chi2(df) (Gamma(df / 2, 1 / 2)), torch.distributions' formulas. StudentT draws as
loc + scale * X / sqrt(Z / df) with X normal and Z a Chi2 draw (no reparameterized sample: rsample raises)."""
import math

from ..autograd.grad_mode import no_grad
from ..ops.creation import randn
from ..ops.special_fns import digamma, lgamma
from .distribution import Distribution, broadcast_all
from .gamma import Gamma, standard_gamma


class Chi2(Gamma):
    def __init__(self, df, validate_args=None):
        (df,) = broadcast_all(df)
        super().__init__(0.5 * df, df * 0 + 0.5, validate_args)

    @property
    def df(self):
        return self.concentration * 2


class StudentT(Distribution):
    def __init__(self, df, loc=0.0, scale=1.0, validate_args=None):
        self.df, self.loc, self.scale = broadcast_all(df, loc, scale)
        super().__init__(self.df.shape, (), validate_args)
        self._check_param("df", self.df > 0, "GreaterThan(lower_bound=0.0)")
        self._check_param("scale", self.scale > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        return self.loc.masked_fill(self.df <= 1, float("nan"))

    @property
    def mode(self):
        return self.loc

    @property
    def variance(self):
        v = self.scale.pow(2) * self.df / (self.df - 2).clamp(min=1e-30)
        v = v.masked_fill((self.df <= 2) & (self.df > 1), math.inf)
        return v.masked_fill(self.df <= 1, float("nan"))

    def sample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        with no_grad():
            x = randn(*shape, dtype=self.df.dtype, device=self.df.device)
            z = 2 * standard_gamma(0.5 * self.df, shape)   # Chi2(df)
            return self.loc + self.scale * x * (self.df / z).sqrt()

    def log_prob(self, value):
        y = (self._value(value) - self.loc) / self.scale
        z = (self.scale.log() + 0.5 * self.df.log() + 0.5 * math.log(math.pi) + lgamma(0.5 * self.df)
             - lgamma(0.5 * (self.df + 1.0)))
        return -0.5 * (self.df + 1.0) * (y.pow(2) / self.df).log1p() - z

    def entropy(self):
        lbeta = lgamma(0.5 * self.df) + math.lgamma(0.5) - lgamma(0.5 * (self.df + 1))
        return (self.scale.log() + 0.5 * (self.df + 1) * (digamma(0.5 * (self.df + 1)) - digamma(0.5 * self.df))
                + 0.5 * self.df.log() + lbeta)
