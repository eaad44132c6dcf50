"""Distribution: torch.distributions' base class (shapes, sample / rsample over a sample_shape, log_prob, cdf,
icdf, entropy, mean, variance, stddev, perplexity) and broadcast_all for the parameters."""
import math
import numbers

from ..autograd.grad_mode import no_grad
from ..errors import ShapeError
from ..tensor import Size, Tensor


def broadcast_all(*values):
    """The parameters as tensors of one broadcast shape: Python numbers become tensors of the first tensor's dtype and
    device (the default dtype when there is none), as torch.distributions.utils.broadcast_all."""
    from .. import broadcast_tensors, get_default_dtype, tensor
    ref = next((v for v in values if isinstance(v, Tensor)), None)
    out = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, numbers.Number):
            out.append(tensor(float(v), dtype=ref.dtype if ref is not None else get_default_dtype(),
                              device=ref.device if ref is not None else None))
        else:
            raise TypeError(f"distribution parameters must be tensors or numbers, got {type(v).__name__}")
    try:
        return broadcast_tensors(*out)
    except (ValueError, ShapeError) as e:
        raise ShapeError(f"distribution parameters of shapes {[tuple(v.shape) for v in out]} do not broadcast") from e


class Distribution:
    """The base of every distribution: batch_shape (independent draws) and event_shape (one draw's shape)."""
    has_rsample = False
    _validate_default = True

    def __init__(self, batch_shape=(), event_shape=(), validate_args=None):
        self._batch_shape = Size(tuple(batch_shape))
        self._event_shape = Size(tuple(event_shape))
        self._validate = self._validate_default if validate_args is None else bool(validate_args)

    @staticmethod
    def set_default_validate_args(value):
        Distribution._validate_default = bool(value)

    @property
    def batch_shape(self):
        return self._batch_shape

    @property
    def event_shape(self):
        return self._event_shape

    def _extended_shape(self, sample_shape=()):
        if isinstance(sample_shape, int):
            sample_shape = (sample_shape,)
        return tuple(sample_shape) + tuple(self._batch_shape) + tuple(self._event_shape)

    def sample(self, sample_shape=()):
        """A draw of shape sample_shape + batch_shape + event_shape, outside autograd."""
        with no_grad():
            return self.rsample(sample_shape)

    def rsample(self, sample_shape=()):
        raise NotImplementedError(f"{type(self).__name__} has no reparameterized sample (has_rsample is False); use "
                                  f".sample()")

    def sample_n(self, n):
        return self.sample((n,))

    def log_prob(self, value):
        raise NotImplementedError(f"{type(self).__name__}.log_prob")

    def cdf(self, value):
        raise NotImplementedError(f"{type(self).__name__}.cdf")

    def icdf(self, value):
        raise NotImplementedError(f"{type(self).__name__}.icdf")

    def entropy(self):
        raise NotImplementedError(f"{type(self).__name__}.entropy")

    @property
    def mean(self):
        raise NotImplementedError(f"{type(self).__name__}.mean")

    @property
    def mode(self):
        raise NotImplementedError(f"{type(self).__name__}.mode")

    @property
    def variance(self):
        raise NotImplementedError(f"{type(self).__name__}.variance")

    @property
    def stddev(self):
        return self.variance.sqrt()

    def perplexity(self):
        return self.entropy().exp()

    # ----------------------------------------------------------------------- argument checks (validate_args)
    def _check_param(self, name, ok, constraint):
        """Raise ValueError naming the parameter when the bool tensor `ok` is not all True (validate_args)."""
        if self._validate and not bool(ok.all()):
            raise ValueError(f"{type(self).__name__}: expected parameter {name} to satisfy the constraint "
                             f"{constraint}")

    def _check_value(self, ok, support):
        if self._validate and not bool(ok.all()):
            raise ValueError(f"{type(self).__name__}: the value is outside the support {support}")

    def _value(self, value):
        if not isinstance(value, Tensor):
            from .. import tensor
            value = tensor(value, dtype=self._dtype(), device=self._device())
        return value

    def _dtype(self):
        return next(v for v in vars(self).values() if isinstance(v, Tensor)).dtype

    def _device(self):
        return next(v for v in vars(self).values() if isinstance(v, Tensor)).device

    def __repr__(self):
        params = ", ".join(f"{k}: {tuple(v.shape) if v.ndim else float(v.detach().cpu().numpy())}"
                           for k, v in vars(self).items() if isinstance(v, Tensor) and not k.startswith("_"))
        return f"{type(self).__name__}({params})"


_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def finfo(dtype):
    """ml_dtypes.finfo of a FLAME floating dtype (eps, tiny, min, max)."""
    import ml_dtypes
    return ml_dtypes.finfo(dtype.np)
