"""PyTorch's torch.nn.utils.parametrizations: weight_norm, spectral_norm and orthogonal as parametrizations
(flame_nn.utils.parametrize), with PyTorch's state_dict keys: parametrizations.<name>.original0 / original1 (g, v),
parametrizations.<name>.original with parametrizations.<name>.0._u / _v (spectral norm) or .0.base (orthogonal)."""
import numpy as np

import flame_core as flame
from flame_core.autograd import no_grad
from flame_core.tensor import Tensor

from .. import functional as F
from ..layers import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from ..module import Module
from ..norm_reparam import _norm_except_dim
from . import parametrize


def _named_tensor(module, name):
    weight = getattr(module, name, None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"Module '{module}' has no parameter or buffer with name '{name}'")
    return weight


class _WeightNorm(Module):
    """weight = v * g / ||v||, the norm over every dim but `dim` (-1: over all); originals (g, v)."""

    def __init__(self, dim=0):
        super().__init__()
        self.dim = -1 if dim is None else dim

    def forward(self, weight_g, weight_v):
        return weight_v * (weight_g / _norm_except_dim(weight_v, self.dim))

    def right_inverse(self, weight):
        return _norm_except_dim(weight, self.dim), weight


def weight_norm(module, name="weight", dim=0):
    """module.<name> = g * v / ||v|| (norm over every dim but `dim`; None: over all), g and v the parameters
    parametrizations.<name>.original0 and original1. Checkpoints of the older hook form (`<name>_g`, `<name>_v`)
    load into it (a load_state_dict pre-hook renames them, as PyTorch's). Returns module."""
    parametrize.register_parametrization(module, name, _WeightNorm(dim), unsafe=True)

    def old_keys(mod, state, prefix, meta, strict, missing, unexpected, errors):
        g, v = f"{prefix}{name}_g", f"{prefix}{name}_v"
        if g in state and v in state:
            state[f"{prefix}parametrizations.{name}.original0"] = state.pop(g)
            state[f"{prefix}parametrizations.{name}.original1"] = state.pop(v)
    module.register_load_state_dict_pre_hook(old_keys)
    return module


class _SpectralNorm(Module):
    """weight / sigma, sigma the largest singular value of the weight as a matrix (dim `dim` first, the rest
    flattened), estimated by power iteration on the buffers _u, _v (n_power_iterations steps per training forward);
    a 1-D weight is divided by its norm."""

    def __init__(self, weight, n_power_iterations=1, dim=0, eps=1e-12):
        super().__init__()
        ndim = weight.ndim
        if dim >= ndim or dim < -ndim:
            raise IndexError(f"Dimension out of range (expected to be in range of [-{ndim}, {ndim - 1}] but got {dim})")
        if n_power_iterations <= 0:
            raise ValueError(f"Expected n_power_iterations to be positive, but got n_power_iterations="
                             f"{n_power_iterations}")
        self.dim, self.eps = dim % ndim, eps
        if ndim > 1:
            self.n_power_iterations = n_power_iterations
            mat = self._matrix(weight).detach()
            h, w = mat.shape
            with no_grad():
                self.register_buffer("_u", F.normalize(flame.randn(h, dtype=mat.dtype, device=mat.device), dim=0,
                                                       eps=eps))
                self.register_buffer("_v", F.normalize(flame.randn(w, dtype=mat.dtype, device=mat.device), dim=0,
                                                       eps=eps))
                self._power_method(mat, 15)  # start u, v near the singular vectors

    def _matrix(self, weight):
        if self.dim != 0:
            weight = weight.permute(self.dim, *[d for d in range(weight.ndim) if d != self.dim])
        return weight.reshape(weight.shape[0], -1)

    def _power_method(self, mat, n_power_iterations):
        with no_grad():
            for _ in range(n_power_iterations):
                self._u.copy_(F.normalize(mat @ self._v, dim=0, eps=self.eps))
                self._v.copy_(F.normalize(mat.mT @ self._u, dim=0, eps=self.eps))

    def forward(self, weight):
        if weight.ndim == 1:
            return F.normalize(weight, dim=0, eps=self.eps)
        mat = self._matrix(weight)
        if self.training:
            self._power_method(mat.detach(), self.n_power_iterations)
        sigma = (self._u.clone() * (mat @ self._v.clone())).sum()
        return weight / sigma

    def right_inverse(self, value):
        return value


def spectral_norm(module, name="weight", n_power_iterations=1, eps=1e-12, dim=None):
    """module.<name> = W / sigma(W) (see _SpectralNorm); dim: the output dim (default 1 for transposed convolutions,
    else 0). Returns module."""
    weight = _named_tensor(module, name)
    if dim is None:
        dim = 1 if isinstance(module, (ConvTranspose1d, ConvTranspose2d, ConvTranspose3d)) else 0
    return parametrize.register_parametrization(module, name, _SpectralNorm(weight, n_power_iterations, dim, eps))


def _on_host(t):
    """t as a NumPy array NumPy's linalg takes (float32 or float64)."""
    a = t.detach().cpu().numpy()
    return a if a.dtype in (np.float32, np.float64) else a.astype(np.float32)


def _like(array, t):
    return flame.tensor(np.ascontiguousarray(array), dtype=t.dtype, device=t.device)


def _make_orthogonal(a):
    """The Q of a = QR with diag(R) >= 0, (..., n, n), host arrays."""
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def _householder_product(V, tau):
    """The first k columns of H_1 ... H_k, H_i = I - tau_i v_i v_i^T, v_i the columns of V (..., n, k)."""
    n, k = V.shape[-2], V.shape[-1]
    Q = flame.eye(n, k, dtype=V.dtype, device=V.device).expand(*V.shape)
    for i in reversed(range(k)):
        v = V[..., i:i + 1]
        Q = Q - tau[..., i:i + 1].unsqueeze(-1) * (v @ (v.mT @ Q))
    return Q


class _Orthogonal(Module):
    """An orthogonal (semi-orthogonal when not square) matrix, or batch of them, from an unconstrained one: the matrix
    exponential or the Cayley map of the skew-symmetric part of its lower triangle, or a product of Householder
    reflections from its strictly lower triangle. With use_trivialization the result multiplies `base` (an
    orthogonal matrix set by right_inverse), so assigning a weight only sets base."""

    def __init__(self, weight, orthogonal_map, *, use_trivialization=True):
        super().__init__()
        self.shape = tuple(weight.shape)
        self.orthogonal_map = orthogonal_map
        if use_trivialization:
            self.register_buffer("base", None)

    def forward(self, X):
        n, k = X.shape[-2], X.shape[-1]
        transposed = n < k
        if transposed:
            X, n, k = X.mT, k, n
        if self.orthogonal_map == "householder":
            A = X.tril(-1)
            tau = 2.0 / (1.0 + (A * A).sum(-2))
            Q = _householder_product(A + flame.eye(n, k, dtype=X.dtype, device=X.device), tau)
            # the diagonal of X (+-1) flips columns; PyTorch takes it through an int cast: no gradient
            Q = Q * X.diagonal(dim1=-2, dim2=-1).detach().trunc().unsqueeze(-2)
        else:
            X = X.tril()
            if n != k:
                X = flame.cat([X, flame.zeros(*X.shape[:-2], n, n - k, dtype=X.dtype, device=X.device)], dim=-1)
            A = X - X.mT
            if self.orthogonal_map == "matrix_exp":
                Q = flame.linalg.matrix_exp(A)
            else:  # the Cayley map (I - A/2)^-1 (I + A/2)
                eye = flame.eye(n, dtype=A.dtype, device=A.device)
                Q = flame.linalg.solve(eye - 0.5 * A, eye + 0.5 * A)
            Q = Q[..., :k]
        if "base" in self._buffers:
            Q = self.base @ Q
        return Q.mT if transposed else Q

    def right_inverse(self, Q):
        if tuple(Q.shape) != self.shape:
            raise ValueError(f"Expected a matrix or batch of matrices of shape {self.shape}. Got a tensor of shape "
                             f"{tuple(Q.shape)}.")
        n, k = Q.shape[-2], Q.shape[-1]
        transpose = n < k
        q = _on_host(Q.mT if transpose else Q)
        n, k = max(n, k), min(n, k)
        if "base" not in self._buffers:
            if self.orthogonal_map != "householder":
                raise NotImplementedError("It is not possible to assign to the matrix exponential or the Cayley "
                                          "parametrizations when use_trivialization=False.")
            # the Householder vectors of q's QR (LAPACK's geqrf); the diagonal keeps the signs of R, flipped where
            # LAPACK used no reflection (tau 0: forward uses tau 2 there)
            h, tau = np.linalg.qr(q, mode="raw")
            a = np.swapaxes(h, -1, -2).copy()
            diag = np.sign(np.diagonal(a, axis1=-2, axis2=-1)) * np.where(tau == 0, -1, 1)
            idx = np.arange(k)
            a[..., idx, idx] = diag
            return _like(np.swapaxes(a, -1, -2) if transpose else a, Q)
        if n == k:
            eye = np.eye(k, dtype=q.dtype)
            orthogonal = np.allclose(np.swapaxes(q, -1, -2) @ q, eye, atol=10 * n * np.finfo(q.dtype).eps)
            base = q.copy() if orthogonal else _make_orthogonal(q)
        else:  # complete q with random columns to an orthogonal n x n
            extra = _on_host(flame.randn(*q.shape[:-2], n, n - k, dtype=Q.dtype))
            base = _make_orthogonal(np.concatenate([q, extra.astype(q.dtype)], axis=-1))
        self.base = _like(base, Q)
        # -I: householder(-I) is the identity's first columns, so the weight is base's first columns
        return -flame.eye(Q.shape[-2], Q.shape[-1], dtype=Q.dtype, device=Q.device).expand(*Q.shape).contiguous()


def orthogonal(module, name="weight", orthogonal_map=None, *, use_trivialization=True):
    """module.<name> (a matrix or a batch of them, the last two dims) constrained orthogonal (semi-orthogonal when not
    square). orthogonal_map: "matrix_exp", "cayley" or "householder"; None: "matrix_exp" for square matrices, else
    "householder" (PyTorch's choice for real matrices). use_trivialization: the map is applied around a stored
    orthogonal `base` (parametrizations.<name>.0.base), so that assigning an orthogonal weight is exact. Returns
    module."""
    weight = _named_tensor(module, name)
    if weight.ndim < 2:
        raise ValueError(f"Expected a matrix or batch of matrices. Got a tensor of {weight.ndim} dimensions.")
    if orthogonal_map is None:
        orthogonal_map = "matrix_exp" if weight.shape[-2] == weight.shape[-1] else "householder"
    if orthogonal_map not in ("matrix_exp", "cayley", "householder"):
        raise ValueError(f'orthogonal_map has to be one of "matrix_exp", "cayley", "householder". Got: '
                         f'{orthogonal_map}')
    orth = _Orthogonal(weight, orthogonal_map, use_trivialization=use_trivialization)
    return parametrize.register_parametrization(module, name, orth, unsafe=True)
