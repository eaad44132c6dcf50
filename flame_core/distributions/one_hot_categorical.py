"""OneHotCategorical(probs=None, logits=None): a Categorical whose draws are one-hot vectors (event shape (K,))."""
from .categorical import Categorical
from .distribution import Distribution


class OneHotCategorical(Distribution):
    def __init__(self, probs=None, logits=None, validate_args=None):
        self._categorical = Categorical(probs, logits, validate_args)
        self.probs, self.logits = self._categorical.probs, self._categorical.logits
        super().__init__(self._categorical.batch_shape, self.probs.shape[-1:], validate_args)

    @property
    def mean(self):
        return self.probs

    @property
    def mode(self):
        from ..ops.indexing import one_hot
        return one_hot(self._categorical.mode, self.probs.shape[-1]).to(self.probs.dtype)

    @property
    def variance(self):
        return self.probs * (1 - self.probs)

    def sample(self, sample_shape=()):
        from ..ops.indexing import one_hot
        return one_hot(self._categorical.sample(sample_shape), self.probs.shape[-1]).to(self.probs.dtype)

    def log_prob(self, value):
        return self._categorical.log_prob(self._value(value).argmax(-1))

    def entropy(self):
        return self._categorical.entropy()
