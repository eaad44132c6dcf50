"""MultivariateNormal(loc, covariance_matrix=None, precision_matrix=None, scale_tril=None), as
torch.distributions.MultivariateNormal: everything through the lower Cholesky factor L of the covariance."""
import math

from .. import linalg
from ..ops.creation import randn
from .distribution import Distribution


class MultivariateNormal(Distribution):
    has_rsample = True

    def __init__(self, loc, covariance_matrix=None, precision_matrix=None, scale_tril=None, validate_args=None):
        from .. import broadcast_shapes, eye
        given = [m for m in (covariance_matrix, precision_matrix, scale_tril) if m is not None]
        if len(given) != 1:
            raise ValueError("MultivariateNormal: pass exactly one of covariance_matrix, precision_matrix or "
                             "scale_tril")
        if loc.ndim < 1:
            raise ValueError("MultivariateNormal: loc must be at least one-dimensional")
        m = given[0]
        if m.ndim < 2 or m.shape[-1] != m.shape[-2] or m.shape[-1] != loc.shape[-1]:
            raise ValueError(f"MultivariateNormal: the matrix must be (..., {loc.shape[-1]}, {loc.shape[-1]}), got "
                             f"{tuple(m.shape)}")
        self._validate = self._validate_default if validate_args is None else bool(validate_args)
        if scale_tril is not None:
            self._unbroadcasted_scale_tril = scale_tril
            self._check_param("scale_tril", scale_tril.diagonal(dim1=-2, dim2=-1) > 0,
                              "LowerCholesky() (positive diagonal)")
        elif covariance_matrix is not None:
            self._unbroadcasted_scale_tril = linalg.cholesky(covariance_matrix)
        else:
            # L of the covariance P^-1: (flip(cholesky(flip(P)))^T)^-1, lower triangular, as PyTorch's
            # _precision_to_scale_tril
            n = precision_matrix.shape[-1]
            l_inv = linalg.cholesky(precision_matrix.flip((-2, -1))).flip((-2, -1)).mT
            ident = eye(n, dtype=precision_matrix.dtype, device=precision_matrix.device)
            self._unbroadcasted_scale_tril = linalg.solve_triangular(l_inv, ident, upper=False)
        batch = broadcast_shapes(tuple(loc.shape[:-1]), tuple(self._unbroadcasted_scale_tril.shape[:-2]))
        self.loc = loc.expand(*(tuple(batch) + (loc.shape[-1],)))
        super().__init__(batch, loc.shape[-1:], validate_args)

    @property
    def scale_tril(self):
        return self._unbroadcasted_scale_tril.expand(*(tuple(self.batch_shape) + tuple(self.event_shape) * 2))

    @property
    def covariance_matrix(self):
        L = self._unbroadcasted_scale_tril
        return (L @ L.mT).expand(*(tuple(self.batch_shape) + tuple(self.event_shape) * 2))

    @property
    def precision_matrix(self):
        return linalg.inv(self.covariance_matrix)

    @property
    def mean(self):
        return self.loc

    @property
    def mode(self):
        return self.loc

    @property
    def variance(self):
        return self._unbroadcasted_scale_tril.pow(2).sum(-1).expand(*self.loc.shape)

    def rsample(self, sample_shape=()):
        eps = randn(*self._extended_shape(sample_shape), dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + (self._unbroadcasted_scale_tril @ eps.unsqueeze(-1)).squeeze(-1)

    def _half_log_det(self):
        return self._unbroadcasted_scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    def log_prob(self, value):
        from .. import broadcast_shapes
        diff = self._value(value) - self.loc
        L = self._unbroadcasted_scale_tril
        n = self.event_shape[0]
        shape = tuple(broadcast_shapes(tuple(diff.shape[:-1]), tuple(L.shape[:-2])))
        z = linalg.solve_triangular(L.expand(*(shape + (n, n))), diff.expand(*(shape + (n,))).unsqueeze(-1),
                                    upper=False).squeeze(-1)
        return -0.5 * (n * math.log(2 * math.pi) + (z * z).sum(-1)) - self._half_log_det()

    def entropy(self):
        n = self.event_shape[0]
        h = 0.5 * n * (1.0 + math.log(2 * math.pi)) + self._half_log_det()
        return h.expand(*self.batch_shape) if len(self.batch_shape) else h
