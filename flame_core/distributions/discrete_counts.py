"""The counting distributions: Geometric(probs / logits) (failures before the first success), Poisson(rate) and
Binomial(total_count, probs / logits), torch.distributions' formulas. Poisson draws: sequential multiplication of
uniforms (Knuth) below rate 10, Hormann's transformed rejection with squeeze (PTRS, 1993) above; Binomial draws: the
sum of total_count Bernoulli draws."""

from ..autograd.grad_mode import no_grad
from ..ops.activation import softplus
from ..ops.creation import rand
from ..ops.math_ops import xlogy
from ..ops.special_fns import lgamma
from .distribution import Distribution, broadcast_all, finfo
from .probs import binary_params


class Geometric(Distribution):
    def __init__(self, probs=None, logits=None, validate_args=None):
        _, self.probs, self.logits = binary_params(self, "Geometric", probs, logits, validate_args)
        super().__init__(self.probs.shape, (), validate_args)

    @property
    def mean(self):
        return 1.0 / self.probs - 1.0

    @property
    def mode(self):
        return self.probs * 0

    @property
    def variance(self):
        return (1.0 / self.probs - 1.0) / self.probs

    def sample(self, sample_shape=()):
        with no_grad():
            u = rand(*self._extended_shape(sample_shape), dtype=self.probs.dtype, device=self.probs.device)
            u = u.clamp(min=float(finfo(self.probs.dtype).tiny))
            return (u.log() / (-self.probs).log1p()).floor()

    def log_prob(self, value):
        value = self._value(value)
        self._check_value((value >= 0) & (value == value.floor()), "IntegerGreaterThan(lower_bound=0)")
        p = self.probs.masked_fill((self.probs == 1) & (value == 0), 0.0)
        return value * (-p).log1p() + self.probs.log()

    def entropy(self):
        return (softplus(self.logits) - self.probs * self.logits) / self.probs


def _poisson_draws(rate, shape):
    """Poisson draws of `shape` (rate broadcast to it), outside autograd."""
    lam = rate.expand(*shape)
    out = lam * 0
    small = lam < 10
    if bool(small.any()):   # Knuth: count the uniforms whose running product stays above exp(-rate)
        limit = (-lam).exp()
        prod = lam * 0 + 1
        k = lam * 0
        live = small
        for i in range(256):
            prod = prod * rand(*shape, dtype=lam.dtype, device=lam.device)
            more = live & (prod > limit)
            k = k + more.to(k.dtype)
            live = more
            if i % 8 == 7 and not bool(live.any()):   # a host read every 8 rounds, not each (done ones stay done)
                break
        else:
            raise RuntimeError("Poisson draws: a count above 256 at a rate below 10 (probability below 1e-300)")
        out = out.where(~small, k)
    big = ~small
    if bool(big.any()):   # PTRS
        lb = lam.clamp(min=10.0)
        slam, loglam = lb.sqrt(), lb.log()
        b = 0.931 + 2.53 * slam
        a = -0.059 + 0.02483 * b
        inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
        vr = 0.9277 - 3.6224 / (b - 2)
        pending = big
        for _ in range(1000):
            u = rand(*shape, dtype=lam.dtype, device=lam.device) - 0.5
            v = rand(*shape, dtype=lam.dtype, device=lam.device)
            us = 0.5 - u.abs()
            k = ((2 * a / us + b) * u + lb + 0.43).floor()
            fast = (us >= 0.07) & (v <= vr)
            reject = (k < 0) | ((us < 0.013) & (v > us))
            slow = (v.clamp(min=1e-300).log() + inv_alpha.log() - (a / (us * us) + b).log()
                    <= -lb + k * loglam - lgamma(k.clamp(min=0) + 1))
            ok = pending & (fast | (~reject & slow))
            out = out.where(~ok, k)
            pending = pending & ~ok
            if not bool(pending.any()):
                break
        else:
            raise RuntimeError("Poisson draws: not accepted after 1000 rounds of PTRS")
    return out


class Poisson(Distribution):
    def __init__(self, rate, validate_args=None):
        (self.rate,) = broadcast_all(rate)
        super().__init__(self.rate.shape, (), validate_args)
        self._check_param("rate", self.rate >= 0, "GreaterThanEq(lower_bound=0.0)")

    @property
    def mean(self):
        return self.rate

    @property
    def mode(self):
        return self.rate.floor()

    @property
    def variance(self):
        return self.rate

    def sample(self, sample_shape=()):
        with no_grad():
            return _poisson_draws(self.rate, self._extended_shape(sample_shape))

    def log_prob(self, value):
        value = self._value(value)
        self._check_value((value >= 0) & (value == value.floor()), "IntegerGreaterThan(lower_bound=0)")
        return xlogy(value, self.rate) - self.rate - lgamma(value + 1)


class Binomial(Distribution):
    def __init__(self, total_count=1, probs=None, logits=None, validate_args=None):
        (self.total_count,), self.probs, self.logits = binary_params(self, "Binomial", probs, logits, validate_args,
                                                                     total_count)
        self.total_count = self.total_count.to(self.probs.dtype)
        super().__init__(self.probs.shape, (), validate_args)
        self._check_param("total_count", (self.total_count >= 0) & (self.total_count == self.total_count.floor()),
                          "IntegerGreaterThan(lower_bound=0)")

    @property
    def mean(self):
        return self.total_count * self.probs

    @property
    def mode(self):
        return ((self.total_count + 1) * self.probs).floor().clamp(max=self.total_count)

    @property
    def variance(self):
        return self.total_count * self.probs * (1 - self.probs)

    def sample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        n_max = int(self.total_count.max().item()) if self.total_count.numel() else 0
        with no_grad():
            if n_max == 0:
                return self.probs.expand(*shape) * 0
            if n_max > 1_000_000:
                raise ValueError(f"Binomial.sample: total_count up to 1e6 (Bernoulli sums), got {n_max}")
            from ..ops.creation import arange
            u = rand(*(tuple(shape) + (n_max,)), dtype=self.probs.dtype, device=self.probs.device)
            trial = arange(n_max, device=self.probs.device).to(self.probs.dtype)
            hit = (u < self.probs.expand(*shape).unsqueeze(-1)) & (trial < self.total_count.expand(*shape)
                                                                    .unsqueeze(-1))
            return hit.to(self.probs.dtype).sum(-1)

    def log_prob(self, value):
        value = self._value(value)
        n, lg = self.total_count, self.logits
        self._check_value((value >= 0) & (value <= n) & (value == value.floor()), "IntegerInterval(0, total_count)")
        clamp_by_zero = (lg.clamp(min=0) + lg - lg.clamp(max=0)) / 2
        normalize = n * clamp_by_zero + n * (-lg.abs()).exp().log1p() - lgamma(n + 1)
        return value * lg - lgamma(value + 1) - lgamma(n - value + 1) - normalize
