"""Gamma(concentration, rate), torch.distributions' formulas; draws by Marsaglia and Tsang's method (2000) on FLAME's
generator. No reparameterized sample (PyTorch has one through an implicit gradient; here rsample raises)."""
from ..autograd.grad_mode import no_grad
from ..ops.creation import rand, randn
from ..ops.math_ops import xlogy
from ..ops.special_fns import digamma, lgamma
from .distribution import Distribution, broadcast_all, finfo


def standard_gamma(alpha, shape):
    """Gamma(alpha, 1) draws of `shape` (alpha broadcast to it): Marsaglia-Tsang for alpha >= 1, and for alpha < 1 a
    draw at alpha + 1 times u^(1 / alpha). Outside autograd; every element accepted (each round redraws the rest)."""
    with no_grad():
        a = alpha.expand(*shape)
        boost = a < 1
        a1 = a + boost.to(a.dtype)
        d = a1 - 1.0 / 3
        c = (9 * d).rsqrt()
        out = a * 0
        pending = out == 0   # all True
        for _ in range(64):   # the acceptance rate is >= 95% per round: 64 rounds leave nothing in practice
            x = randn(*shape, dtype=a.dtype, device=a.device)
            v = (1 + c * x) ** 3
            u = rand(*shape, dtype=a.dtype, device=a.device)
            ok = (v > 0) & (u.log() < 0.5 * x * x + d - d * v + d * v.clamp(min=1e-30).log())
            take = pending & ok
            out = out.where(~take, d * v)
            pending = pending & ~ok
            if not bool(pending.any()):
                break
        else:
            raise RuntimeError("standard_gamma: draws not accepted after 64 rounds")
        u = rand(*shape, dtype=a.dtype, device=a.device)
        out = out.where(~boost, out * u.clamp(min=float(finfo(a.dtype).tiny)) ** (1 / a))
        return out.clamp(min=float(finfo(a.dtype).tiny))


class Gamma(Distribution):
    def __init__(self, concentration, rate, validate_args=None):
        self.concentration, self.rate = broadcast_all(concentration, rate)
        super().__init__(self.concentration.shape, (), validate_args)
        self._check_param("concentration", self.concentration > 0, "GreaterThan(lower_bound=0.0)")
        self._check_param("rate", self.rate > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        return self.concentration / self.rate

    @property
    def mode(self):
        return ((self.concentration - 1) / self.rate).clamp(min=0)

    @property
    def variance(self):
        return self.concentration / self.rate.pow(2)

    def sample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        with no_grad():
            return standard_gamma(self.concentration, shape) / self.rate.expand(*shape)

    def log_prob(self, value):
        value = self._value(value)
        self._check_value(value >= 0, "GreaterThanEq(lower_bound=0.0)")
        return (xlogy(self.concentration, self.rate) + xlogy(self.concentration - 1, value) - self.rate * value
                - lgamma(self.concentration))

    def entropy(self):
        return (self.concentration - self.rate.log() + lgamma(self.concentration)
                + (1.0 - self.concentration) * digamma(self.concentration))
