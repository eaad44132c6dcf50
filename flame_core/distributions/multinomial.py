"""Multinomial(total_count, probs=None, logits=None): counts of total_count Categorical draws, as
torch.distributions.Multinomial (event shape (K,))."""
import math

from ..autograd.grad_mode import no_grad
from ..ops.special_fns import lgamma
from .categorical import Categorical
from .distribution import Distribution


class Multinomial(Distribution):
    def __init__(self, total_count=1, probs=None, logits=None, validate_args=None):
        if not isinstance(total_count, int) or isinstance(total_count, bool) or total_count < 0:
            raise ValueError(f"Multinomial: total_count must be a non-negative int, got {total_count!r}")
        self.total_count = total_count
        self._categorical = Categorical(probs, logits, validate_args)
        self.probs, self.logits = self._categorical.probs, self._categorical.logits
        super().__init__(self._categorical.batch_shape, self.probs.shape[-1:], validate_args)

    @property
    def mean(self):
        return self.probs * self.total_count

    @property
    def variance(self):
        return self.total_count * self.probs * (1 - self.probs)

    def sample(self, sample_shape=()):
        from ..ops.indexing import one_hot
        if isinstance(sample_shape, int):
            sample_shape = (sample_shape,)
        k = self.probs.shape[-1]
        with no_grad():
            if self.total_count == 0:
                return self.probs.expand(*self._extended_shape(sample_shape)) * 0
            draws = self._categorical.sample((self.total_count,) + tuple(sample_shape))   # (n, sample..., batch...)
            return one_hot(draws, k).to(self.probs.dtype).sum(0)

    def log_prob(self, value):
        from .. import broadcast_tensors
        value = self._value(value)
        self._check_value((value >= 0).all(-1) & (value.sum(-1) == self.total_count),
                          f"Multinomial(total_count={self.total_count}) counts")
        logits, value = broadcast_tensors(self.logits, value)
        logits = logits.masked_fill((value == 0) & (logits == -math.inf), 0.0)
        return lgamma(value.sum(-1) + 1) - lgamma(value + 1).sum(-1) + (logits * value).sum(-1)
