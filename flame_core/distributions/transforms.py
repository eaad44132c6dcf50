"""Transforms for TransformedDistribution, as torch.distributions.transforms: ExpTransform, AffineTransform,
SigmoidTransform, TanhTransform, SoftplusTransform, PowerTransform, ComposeTransform, each with its inverse (`.inv`),
log |det J| (`log_abs_det_jacobian(x, y)`), `sign` (monotone ones) and `event_dim`."""
import math

from ..ops.activation import softplus
from .distribution import finfo


class Transform:
    """The base: a subclass defines `_call`, `_inverse` and `log_abs_det_jacobian` (an abstract one raises, naming
    itself, as PyTorch's base does)."""
    event_dim = 0
    bijective = True
    sign = 1

    @property
    def inv(self):
        return _Inverse(self)

    def __call__(self, x):
        return self._call(x)

    def _call(self, x):
        raise NotImplementedError(f"{type(self).__name__}._call")

    def _inverse(self, y):
        raise NotImplementedError(f"{type(self).__name__}._inverse")

    def log_abs_det_jacobian(self, x, y):
        raise NotImplementedError(f"{type(self).__name__}.log_abs_det_jacobian")

    def __repr__(self):
        return f"{type(self).__name__}()"


class _Inverse(Transform):
    def __init__(self, t):
        self._t = t
        self.event_dim = t.event_dim
        self.sign = t.sign

    @property
    def inv(self):
        return self._t

    def _call(self, x):
        return self._t._inverse(x)

    def _inverse(self, y):
        return self._t._call(y)

    def log_abs_det_jacobian(self, x, y):
        return -self._t.log_abs_det_jacobian(y, x)


class ExpTransform(Transform):
    def _call(self, x):
        return x.exp()

    def _inverse(self, y):
        return y.log()

    def log_abs_det_jacobian(self, x, y):
        return x


class AffineTransform(Transform):
    """y = loc + scale * x; event_dim > 0 sums log |scale| over that many rightmost dims."""

    def __init__(self, loc, scale, event_dim=0):
        self.loc, self.scale, self.event_dim = loc, scale, int(event_dim)

    @property
    def sign(self):
        from ..tensor import Tensor
        return self.scale.sign() if isinstance(self.scale, Tensor) else math.copysign(1.0, self.scale)

    def _call(self, x):
        return self.loc + self.scale * x

    def _inverse(self, y):
        return (y - self.loc) / self.scale

    def log_abs_det_jacobian(self, x, y):
        from ..tensor import Tensor
        if isinstance(self.scale, Tensor):
            r = self.scale.abs().log().expand(*x.shape) if self.scale.shape != x.shape else self.scale.abs().log()
        else:
            r = x * 0 + math.log(abs(self.scale))
        if self.event_dim:
            r = r.reshape(tuple(r.shape[:r.ndim - self.event_dim]) + (-1,)).sum(-1)
        return r


class SigmoidTransform(Transform):
    def _call(self, x):
        fi = finfo(x.dtype)
        return x.sigmoid().clamp(float(fi.tiny), 1 - float(fi.eps))

    def _inverse(self, y):
        fi = finfo(y.dtype)
        y = y.clamp(float(fi.tiny), 1 - float(fi.eps))
        return y.log() - (-y).log1p()

    def log_abs_det_jacobian(self, x, y):
        return -softplus(-x) - softplus(x)


class TanhTransform(Transform):
    def _call(self, x):
        return x.tanh()

    def _inverse(self, y):
        return y.atanh()

    def log_abs_det_jacobian(self, x, y):
        return 2.0 * (math.log(2.0) - x - softplus(-2.0 * x))


class SoftplusTransform(Transform):
    def _call(self, x):
        return softplus(x)

    def _inverse(self, y):
        return (-(-y).expm1()).log() + y

    def log_abs_det_jacobian(self, x, y):
        return -softplus(-x)


class PowerTransform(Transform):
    """y = x ** exponent (x > 0)."""

    def __init__(self, exponent):
        self.exponent = exponent

    @property
    def sign(self):
        from ..tensor import Tensor
        return self.exponent.sign() if isinstance(self.exponent, Tensor) else math.copysign(1.0, self.exponent)

    def _call(self, x):
        return x.pow(self.exponent)

    def _inverse(self, y):
        return y.pow(1 / self.exponent)

    def log_abs_det_jacobian(self, x, y):
        return (self.exponent * y / x).abs().log()


class ComposeTransform(Transform):
    def __init__(self, parts):
        self.parts = list(parts)
        self.event_dim = max((p.event_dim for p in self.parts), default=0)

    @property
    def sign(self):
        s = 1
        for p in self.parts:
            s = s * p.sign
        return s

    @property
    def inv(self):
        return ComposeTransform([p.inv for p in reversed(self.parts)])

    def _call(self, x):
        for p in self.parts:
            x = p(x)
        return x

    def _inverse(self, y):
        for p in reversed(self.parts):
            y = p.inv(y)
        return y

    def log_abs_det_jacobian(self, x, y):
        total = 0.0
        for p in self.parts:
            nxt = p(x)
            lad = p.log_abs_det_jacobian(x, nxt)
            extra = self.event_dim - p.event_dim
            if extra:
                lad = lad.reshape(tuple(lad.shape[:lad.ndim - extra]) + (-1,)).sum(-1)
            total = total + lad
            x = nxt
        return total
