"""Random draws shaped by tensors, with PyTorch's signatures: multinomial, bernoulli (and Tensor.bernoulli_) and
normal (its four overloads). The draws come from the device's generator (or the one passed), as randn / rand do;
they are not PyTorch's random streams (no two frameworks' numbers match), only the same distributions -- the tests
check the distributions and the rules.

multinomial draws with replacement by inverse transform sampling (a uniform against each row's cumulative sums),
without by the Gumbel top-k trick (the k largest of log p + Gumbel noise: k draws without replacement, in order)."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import ShapeError
from ..tensor import Tensor, _wrap
from .creation import rand, randn


def _uniform_like(shape, ref, generator, dtype=np.float64):
    """Uniform [0, 1) draws of `shape` on ref's device, as an array of `dtype`."""
    u = rand(shape, dtype=D.float64 if dtype == np.float64 else D.float32, device=ref.device, generator=generator)
    return u._data


def multinomial(input, num_samples, replacement=False, *, generator=None):
    """Indices drawn from each row of `input` (1-D: one distribution; 2-D: one per row) with probability
    proportional to its (non-negative, finite, not all zero) weights; without replacement at most as many as a row
    has non-zero weights, as torch.multinomial."""
    if input.ndim not in (1, 2):
        raise ShapeError(f"multinomial: input must be 1-D or 2-D, got {tuple(input.shape)}")
    if not input.dtype.is_floating_point:
        raise TypeError(f"multinomial: input must be a floating point tensor, got {input.dtype}")
    if num_samples <= 0:
        raise ValueError(f"multinomial: num_samples must be positive, got {num_samples}")
    a = input._data
    xp = backend.xp_of(a)
    p = (a.astype(np.float64)).reshape(-1, a.shape[-1])
    if not bool(xp.isfinite(p).all()) or bool((p < 0).any()):
        raise ValueError("multinomial: probability tensor contains either inf, nan or an element < 0")
    total = p.sum(axis=1, keepdims=True)
    if bool((total <= 0).any()):
        raise ValueError("multinomial: invalid probability distribution (a row sums to 0)")
    rows, n = p.shape
    if not replacement:
        nonzero = int((p > 0).sum(axis=1).min())
        if num_samples > nonzero:
            raise ValueError(f"multinomial: cannot draw {num_samples} samples without replacement from a row with "
                             f"{nonzero} non-zero weights")
        u = _uniform_like((rows, n), input, generator)
        gumbel = -xp.log(-xp.log(xp.clip(u, 1e-300, 1.0)))
        keys = xp.where(p > 0, xp.log(xp.where(p > 0, p, 1.0)) + gumbel, -np.inf)
        order = xp.argsort(-keys, axis=1)[:, :num_samples]
    else:
        # inverse transform on the unnormalised cumulative sums: a zero weight's interval is empty, and trailing
        # zeros add exactly 0, so u * total never passes the last non-zero weight but by rounding -- clamped there
        cdf = xp.cumsum(p, axis=1)
        u = _uniform_like((rows, num_samples), input, generator) * cdf[:, -1:]
        last = n - 1 - xp.argmax(xp.flip(p > 0, axis=1), axis=1)
        order = xp.empty((rows, num_samples), dtype=np.int64)
        for r in range(rows):
            order[r] = xp.minimum(xp.searchsorted(cdf[r], u[r], side="right"), last[r])
    out = order.astype(np.int64)
    return _wrap(out.reshape(num_samples) if input.ndim == 1 else out)


def bernoulli(input, p=None, *, generator=None):
    """Draws of 1 with probability input (or the scalar p) and 0 otherwise, in input's dtype."""
    probs = input._data if p is None else None
    if p is not None and not (0 <= p <= 1):
        raise ValueError(f"bernoulli: p must be in [0, 1], got {p}")
    if probs is not None:
        xp = backend.xp_of(probs)
        pf = probs.astype(np.float64)
        if bool(((pf < 0) | (pf > 1) | xp.isnan(pf)).any()):
            raise ValueError("bernoulli: the probabilities must lie in [0, 1]")
    u = _uniform_like(tuple(input.shape), input, generator)
    draw = u < (p if p is not None else pf)
    return _wrap(draw.astype(input._data.dtype))


def bernoulli_(self, p=0.5, *, generator=None):
    """self <- draws of 1 with probability p (a float, or a tensor broadcast to self's shape), in place."""
    from .inplace import _check_inplace
    _check_inplace(self)
    u = _uniform_like(tuple(self.shape), self, generator)
    pa = p._data.astype(np.float64) if isinstance(p, Tensor) else float(p)
    self._data[...] = (u < pa).astype(self._data.dtype)
    self._version[0] += 1
    return self


def normal(mean, std=1.0, size=None, *, generator=None, dtype=None, device=None, requires_grad=False):
    """Normal draws: normal(mean_tensor, std_tensor) elementwise (broadcast), normal(mean_tensor, std=float),
    normal(mean=float, std_tensor), or normal(mean=float, std=float, size) -- as torch.normal. The result does not
    require grad (reparameterise as mean + std * randn for gradients)."""
    mt, st = isinstance(mean, Tensor), isinstance(std, Tensor)
    if not mt and not st:
        if size is None:
            raise TypeError("normal: with float mean and std, pass size=")
        if std < 0:
            raise ValueError(f"normal: std must be non-negative, got {std}")
        z = randn(size, dtype=dtype, device=device, generator=generator)
        out = z * std + mean
        return out.requires_grad_(True) if requires_grad else out
    if size is not None:
        raise TypeError("normal: size= goes with float mean and std only")
    ref = mean if mt else std
    if st and bool((std._data < 0).any()):
        raise ValueError("normal: std must be non-negative")
    m = mean.detach() if mt else mean
    s = std.detach() if st else std
    if mt and st:
        shape = tuple(np.broadcast_shapes(tuple(mean.shape), tuple(std.shape)))
    else:
        shape = tuple(ref.shape)
    z = randn(shape, dtype=ref.dtype, device=ref.device, generator=generator)
    return z * s + m



def _fill_draws(self, op, transform, generator):
    """self <- transform(u) for uniform (0, 1) draws u (float64) of self's shape, in place (PyTorch's X_ draws)."""
    from .inplace import _check_inplace
    if not self.dtype.is_floating_point:
        raise TypeError(f"{op}: expects a floating point tensor, got {self.dtype}")
    _check_inplace(self)
    u = _uniform_like(tuple(self.shape), self, generator)
    xp = backend.xp_of(u)
    u = xp.maximum(u, np.finfo(np.float64).tiny)   # (0, 1): the logs below stay finite
    self._data[...] = transform(xp, u).astype(self._data.dtype)
    self._version[0] += 1
    return self


def exponential_(self, lambd=1.0, *, generator=None):
    """self <- exponential draws of rate lambd (-log(u) / lambd)."""
    if not lambd > 0:
        raise ValueError(f"exponential_: lambd must be positive, got {lambd}")
    return _fill_draws(self, "exponential_", lambda xp, u: -xp.log(u) / lambd, generator)


def geometric_(self, p, *, generator=None):
    """self <- geometric draws: the number of Bernoulli(p) trials up to the first success (1, 2, ...)."""
    if not 0 < p <= 1:
        raise ValueError(f"geometric_: p must be in (0, 1], got {p}")
    if p == 1:
        return _fill_draws(self, "geometric_", lambda xp, u: xp.ones_like(u), generator)
    return _fill_draws(self, "geometric_", lambda xp, u: xp.ceil(xp.log(u) / np.log1p(-p)), generator)


def log_normal_(self, mean=1.0, std=2.0, *, generator=None):
    """self <- exp(N(mean, std)) draws."""
    if not std > 0:
        raise ValueError(f"log_normal_: std must be positive, got {std}")
    from .inplace import _check_inplace
    if not self.dtype.is_floating_point:
        raise TypeError(f"log_normal_: expects a floating point tensor, got {self.dtype}")
    _check_inplace(self)
    z = randn(tuple(self.shape), dtype=D.float64, device=self.device, generator=generator)._data
    self._data[...] = backend.xp_of(z).exp(z * std + mean).astype(self._data.dtype)
    self._version[0] += 1
    return self


def cauchy_(self, median=0.0, sigma=1.0, *, generator=None):
    """self <- Cauchy draws: median + sigma * tan(pi * (u - 1/2))."""
    if not sigma > 0:
        raise ValueError(f"cauchy_: sigma must be positive, got {sigma}")
    return _fill_draws(self, "cauchy_", lambda xp, u: median + sigma * xp.tan(np.pi * (u - 0.5)), generator)


_MANTISSA_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}


def random_(self, from_=0, to=None, *, generator=None):
    """self <- integers drawn uniformly from [from_, to) (random_(to): [0, to); random_(): [0, 2 ** mantissa bits]
    for floats, the dtype's range for integers), as PyTorch's Tensor.random_."""
    from .creation import randint
    from .inplace import _check_inplace
    if to is None and from_ != 0:
        from_, to = 0, from_
    if to is None:
        dt = self.dtype
        if dt.is_floating_point:
            to = (1 << _MANTISSA_BITS[dt.name]) + 1   # every integer up to 2 ** bits is exact in the dtype
        elif dt.name == "bool":
            to = 2
        else:
            to = int(np.iinfo(dt.np).max) + 1
    if from_ >= to:
        raise ValueError(f"random_: expects from ({from_}) < to ({to})")
    _check_inplace(self)
    r = randint(from_, to, tuple(self.shape), generator=generator, device=self.device)
    self._data[...] = r._data.astype(self._data.dtype)
    self._version[0] += 1
    return self
