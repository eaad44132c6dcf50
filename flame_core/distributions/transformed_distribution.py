"""TransformedDistribution(base_distribution, transforms) and the families PyTorch builds from it here: Pareto,
RelaxedBernoulli (LogitRelaxedBernoulli + sigmoid), RelaxedOneHotCategorical (ExpRelaxedCategorical + exp), as
torch.distributions."""
import math

from ..ops.activation import softplus
from ..ops.creation import rand
from ..ops.reduction import logsumexp
from .distribution import Distribution, broadcast_all
from .exponential import Exponential
from .independent import _sum_rightmost
from .probs import binary_params, clamp_probs
from .transforms import AffineTransform, ExpTransform, SigmoidTransform, Transform


class TransformedDistribution(Distribution):
    def __init__(self, base_distribution, transforms, validate_args=None):
        if isinstance(transforms, Transform):
            transforms = [transforms]
        transforms = list(transforms)
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"TransformedDistribution: transforms must be Transforms, got {type(t).__name__}")
        self.base_dist = base_distribution
        self.transforms = transforms
        shape = tuple(base_distribution.batch_shape) + tuple(base_distribution.event_shape)
        event_dim = max([len(base_distribution.event_shape)] + [t.event_dim for t in transforms])
        if event_dim > len(shape):
            raise ValueError(f"TransformedDistribution: a transform with event_dim {event_dim} on a base of shape "
                             f"{shape}")
        cut = len(shape) - event_dim
        super().__init__(shape[:cut], shape[cut:], validate_args)

    @property
    def has_rsample(self):
        return self.base_dist.has_rsample

    def sample(self, sample_shape=()):
        x = self.base_dist.sample(sample_shape)
        for t in self.transforms:
            x = t(x)
        return x

    def rsample(self, sample_shape=()):
        x = self.base_dist.rsample(sample_shape)
        for t in self.transforms:
            x = t(x)
        return x

    def log_prob(self, value):
        event_dim = len(self.event_shape)
        lp = 0.0
        y = self._value(value)
        for t in reversed(self.transforms):
            x = t.inv(y)
            lp = lp - _sum_rightmost(t.log_abs_det_jacobian(x, y), event_dim - t.event_dim)
            y = x
        return lp + _sum_rightmost(self.base_dist.log_prob(y), event_dim - len(self.base_dist.event_shape))

    def _monotonize(self, value):
        sign = 1
        for t in self.transforms:
            sign = sign * t.sign
        if isinstance(sign, (int, float)) and sign == 1:
            return value
        return sign * (value - 0.5) + 0.5

    def cdf(self, value):
        y = self._value(value)
        for t in reversed(self.transforms):
            y = t.inv(y)
        return self._monotonize(self.base_dist.cdf(y))

    def icdf(self, value):
        x = self.base_dist.icdf(self._monotonize(self._value(value)))
        for t in self.transforms:
            x = t(x)
        return x

    def _dtype(self):
        return self.base_dist._dtype()

    def _device(self):
        return self.base_dist._device()


class Pareto(TransformedDistribution):
    """scale * exp(E) for E ~ Exponential(alpha)."""

    def __init__(self, scale, alpha, validate_args=None):
        self.scale, self.alpha = broadcast_all(scale, alpha)
        super().__init__(Exponential(self.alpha, validate_args),
                         [ExpTransform(), AffineTransform(0.0, self.scale)], validate_args)
        self._check_param("scale", self.scale > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        a = self.alpha.clamp(min=1.0 + 1e-12)
        return (a * self.scale / (a - 1)).masked_fill(self.alpha <= 1, math.inf)

    @property
    def mode(self):
        return self.scale

    @property
    def variance(self):
        a = self.alpha.clamp(min=2.0 + 1e-12)
        return (self.scale.pow(2) * a / ((a - 1).pow(2) * (a - 2))).masked_fill(self.alpha <= 2, math.inf)

    def entropy(self):
        return (self.scale / self.alpha).log() + (1 + self.alpha.reciprocal())


class LogitRelaxedBernoulli(Distribution):
    has_rsample = True

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        (self.temperature,), self.probs, self.logits = binary_params(self, "LogitRelaxedBernoulli", probs, logits,
                                                                     validate_args, temperature)
        super().__init__(self.logits.shape, (), validate_args)

    def rsample(self, sample_shape=()):
        u = clamp_probs(rand(*self._extended_shape(sample_shape), dtype=self.logits.dtype, device=self.logits.device))
        return (u.log() - (-u).log1p() + self.logits) / self.temperature

    def log_prob(self, value):
        diff = self.logits - self._value(value) * self.temperature
        return self.temperature.log() + diff - 2 * softplus(diff)


class RelaxedBernoulli(TransformedDistribution):
    """The Concrete / Gumbel-sigmoid relaxation of a Bernoulli at `temperature` (values in (0, 1))."""

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        base = LogitRelaxedBernoulli(temperature, probs, logits, validate_args)
        super().__init__(base, SigmoidTransform(), validate_args)
        self.temperature, self.probs, self.logits = base.temperature, base.probs, base.logits


class ExpRelaxedCategorical(Distribution):
    has_rsample = True

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        from .categorical import Categorical
        self._categorical = Categorical(probs, logits, validate_args)
        self.logits, self.probs = self._categorical.logits, self._categorical.probs
        (self.temperature,) = broadcast_all(temperature)
        super().__init__(self._categorical.batch_shape, self.probs.shape[-1:], validate_args)

    def rsample(self, sample_shape=()):
        u = clamp_probs(rand(*self._extended_shape(sample_shape), dtype=self.logits.dtype, device=self.logits.device))
        gumbels = -((-u.log()).log())
        scores = (self.logits + gumbels) / self.temperature
        return scores - logsumexp(scores, -1, keepdim=True)

    def log_prob(self, value):
        from ..ops.special_fns import lgamma
        k = self.probs.shape[-1]
        log_scale = lgamma(self.temperature * 0 + float(k)) + self.temperature.log() * (k - 1)
        score = self.logits - self._value(value) * self.temperature
        score = (score - logsumexp(score, -1, keepdim=True)).sum(-1)
        return score + log_scale


class RelaxedOneHotCategorical(TransformedDistribution):
    """The Gumbel-softmax relaxation of a one-hot Categorical at `temperature` (points of the simplex)."""

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        base = ExpRelaxedCategorical(temperature, probs, logits, validate_args)
        super().__init__(base, ExpTransform(), validate_args)
        self.temperature, self.probs, self.logits = base.temperature, base.probs, base.logits


__all__ = ["ExpRelaxedCategorical", "LogitRelaxedBernoulli", "Pareto", "RelaxedBernoulli",
           "RelaxedOneHotCategorical", "TransformedDistribution"]
