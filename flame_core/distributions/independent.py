"""Independent(base, reinterpreted_batch_ndims): the rightmost batch dims of `base` read as event dims (log_prob and
entropy summed over them), as torch.distributions.Independent."""
from .distribution import Distribution


def _sum_rightmost(x, n):
    return x.reshape(tuple(x.shape[:x.ndim - n]) + (-1,)).sum(-1) if n > 0 else x


class Independent(Distribution):
    def __init__(self, base_distribution, reinterpreted_batch_ndims, validate_args=None):
        n = int(reinterpreted_batch_ndims)
        if not 0 <= n <= len(base_distribution.batch_shape):
            raise ValueError(f"Independent: reinterpreted_batch_ndims {n} must be in [0, "
                             f"{len(base_distribution.batch_shape)}] (the base's batch dims)")
        self.base_dist = base_distribution
        self.reinterpreted_batch_ndims = n
        shape = tuple(base_distribution.batch_shape) + tuple(base_distribution.event_shape)
        cut = len(base_distribution.batch_shape) - n
        super().__init__(shape[:cut], shape[cut:], validate_args)

    @property
    def has_rsample(self):
        return self.base_dist.has_rsample

    @property
    def mean(self):
        return self.base_dist.mean

    @property
    def mode(self):
        return self.base_dist.mode

    @property
    def variance(self):
        return self.base_dist.variance

    def sample(self, sample_shape=()):
        return self.base_dist.sample(sample_shape)

    def rsample(self, sample_shape=()):
        return self.base_dist.rsample(sample_shape)

    def log_prob(self, value):
        return _sum_rightmost(self.base_dist.log_prob(value), self.reinterpreted_batch_ndims)

    def entropy(self):
        return _sum_rightmost(self.base_dist.entropy(), self.reinterpreted_batch_ndims)

    def _dtype(self):
        return self.base_dist._dtype()

    def _device(self):
        return self.base_dist._device()
