"""MixtureSameFamily(mixture_distribution, component_distribution): a Categorical over the rightmost batch dim of the
components, as torch.distributions.MixtureSameFamily (log_prob by logsumexp over the components, mean and variance by
the laws of total expectation and variance, draws by picking each sample's component)."""
from ..ops.reduction import logsumexp
from .categorical import Categorical
from .distribution import Distribution


class MixtureSameFamily(Distribution):
    def __init__(self, mixture_distribution, component_distribution, validate_args=None):
        if not isinstance(mixture_distribution, Categorical):
            raise ValueError("MixtureSameFamily: mixture_distribution must be a Categorical")
        cb = tuple(component_distribution.batch_shape)
        if not cb:
            raise ValueError("MixtureSameFamily: the components need a batch dim (the component index, rightmost)")
        k = mixture_distribution.probs.shape[-1]
        if cb[-1] != k:
            raise ValueError(f"MixtureSameFamily: {k} mixture weights for {cb[-1]} components")
        self._mixture_distribution = mixture_distribution
        self._component_distribution = component_distribution
        self._num_component = k
        self._event_ndims = len(component_distribution.event_shape)
        super().__init__(cb[:-1], component_distribution.event_shape, validate_args)

    @property
    def mixture_distribution(self):
        return self._mixture_distribution

    @property
    def component_distribution(self):
        return self._component_distribution

    def _pad(self, probs):
        return probs.reshape(tuple(probs.shape) + (1,) * self._event_ndims)

    @property
    def mean(self):
        p = self._pad(self._mixture_distribution.probs)
        return (p * self._component_distribution.mean).sum(-1 - self._event_ndims)

    @property
    def variance(self):
        p = self._pad(self._mixture_distribution.probs)
        d = -1 - self._event_ndims
        cm = self._component_distribution.mean
        mean_cond_var = (p * self._component_distribution.variance).sum(d)
        var_cond_mean = (p * (cm - self.mean.unsqueeze(d)).pow(2)).sum(d)
        return mean_cond_var + var_cond_mean

    def log_prob(self, value):
        x = self._value(value).unsqueeze(-1 - self._event_ndims)
        return logsumexp(self._component_distribution.log_prob(x) + self._mixture_distribution.logits, -1)

    def cdf(self, value):
        x = self._value(value).unsqueeze(-1 - self._event_ndims)
        return (self._component_distribution.cdf(x) * self._mixture_distribution.probs).sum(-1)

    def sample(self, sample_shape=()):
        from ..autograd.grad_mode import no_grad
        if isinstance(sample_shape, int):
            sample_shape = (sample_shape,)
        with no_grad():
            idx = self._mixture_distribution.sample(sample_shape)                 # sample + batch
            comp = self._component_distribution.sample(sample_shape)              # sample + batch + (K,) + event
            e = tuple(self.event_shape)
            idx = idx.reshape(tuple(idx.shape) + (1,) * (1 + len(e))).expand(*(tuple(idx.shape) + (1,) + e))
            return comp.gather(-1 - len(e), idx).squeeze(-1 - len(e))

    def _dtype(self):
        return self._mixture_distribution.probs.dtype

    def _device(self):
        return self._mixture_distribution.probs.device
