"""The rest of PyTorch's Tensor surface for real dtypes, installed on Tensor: the in-place forms of comparisons,
logical / bitwise and math ops and other names of ops FLAME has; the copy-and-write ops (index_put, put,
masked_scatter, the slice / select / diagonal scatters, index_reduce's in-place form); scans and statistics
(logcumsumexp, cov, corrcoef, mode, histogram, renorm); integer ops (gcd, lcm, the shift operators); in-place draws
(exponential_, geometric_, log_normal_, cauchy_, random_); fill_diagonal_; as_strided and the in-place view ops
(squeeze_, unsqueeze_, t_, transpose_), resize_; apply_ / map_; pin_memory; nonzero_static, dim_order, layout; and
the complex-number queries, which answer for FLAME's real tensors as PyTorch's do for real tensors (conj is the
tensor itself, imag raises)."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import ShapeError
from ..tensor import _wrap
from . import activation as A
from . import bessel as BS
from . import binning as B
from . import covariance as CV
from . import elementwise as E
from . import incomplete_gamma as IG
from . import indexing as I
from . import integer_ops as IO
from . import math_ops as MO
from . import matrix as M
from . import metadata_inplace as MI
from . import order_stats as OS
from . import sampling as SA
from . import scatter_copies as SC
from . import shape as S
from . import sorting as SO
from . import strided as ST
from .creation import ones_like
from .inplace import apply_inplace
from .logcumsumexp import logcumsumexp
from .renorm import renorm


def _inplace_of(fn):
    return lambda self, *args, **kwargs: apply_inplace(
        self, lambda t, *a: fn(t, *a, **kwargs), *args)


def split_with_sizes(x, split_sizes, dim=0):
    """split into pieces of the given sizes, which must add up to the dim's size."""
    return S.split(x, list(split_sizes), dim)


def is_nonzero(x):
    """The truth of a one-element tensor (an error for any other size, as PyTorch's)."""
    n = x.numel()
    if n != 1:
        raise RuntimeError(f"Boolean value of Tensor with {'no values' if n == 0 else 'more than one value'} is "
                           f"ambiguous")
    return bool(x.item())


def is_signed(x):
    return x.dtype.is_floating_point or x.dtype.name in ("int8", "int16", "int32", "int64")


def storage_offset(x):
    """The element offset of x's first element in its storage (the base's data, where x is a view)."""
    root = x._base if x._base is not None else x
    a, r = x._data, root._data
    if backend.is_cuda_array(a):
        return (a.data.ptr - r.data.ptr) // a.itemsize
    return (a.__array_interface__["data"][0] - r.__array_interface__["data"][0]) // a.itemsize


def imag(x):
    raise RuntimeError("imag is not implemented for tensors with non-complex dtypes.")


def fill_diagonal_(self, fill_value, wrap=False):
    """The main diagonal (all indices equal) set to fill_value in place; a tall 2-D matrix's diagonal restarts
    after each N + 1 rows with wrap=True (NumPy's fill_diagonal)."""
    if self.ndim < 2:
        raise ShapeError(f"fill_diagonal_: dimensions must be larger than 1, got shape {tuple(self.shape)}")
    if self.ndim > 2 and len(set(self.shape)) != 1:
        raise ShapeError(f"fill_diagonal_: all dimensions of input must be of equal length, got shape "
                         f"{tuple(self.shape)}")
    mask = np.zeros(tuple(self.shape), dtype=bool)
    np.fill_diagonal(mask, True, wrap=wrap)
    m = _wrap(backend.xp_of(self._data).asarray(mask))
    return apply_inplace(self, lambda t: I.masked_fill(t, m, fill_value))


class _Layout:
    """torch.strided's place: FLAME's tensors are all dense and strided."""

    def __repr__(self):
        return "flame.strided"


STRIDED = _Layout()


def apply_(self, callable):
    """Each element replaced by callable(element), in place; CPU tensors only and slow (a Python call per element),
    as PyTorch's."""
    return map_(self, None, callable)


def map_(self, tensor, callable):
    """self[i] = callable(self[i], tensor[i]) in place (tensor broadcast to self's shape; None: callable(self[i])),
    CPU tensors only, as PyTorch's apply_ / map_."""
    from ..errors import DeviceError
    if backend.is_cuda_array(self._data) or (tensor is not None and backend.is_cuda_array(tensor._data)):
        raise DeviceError("apply_ / map_ are only implemented on CPU tensors")
    from .inplace import _check_inplace
    _check_inplace(self)
    a = self._data
    flat = a.reshape(-1) if a.flags.c_contiguous else a.copy().reshape(-1)
    if tensor is None:
        vals = [callable(v) for v in flat.tolist()]
    else:
        other = np.broadcast_to(tensor._data, a.shape).reshape(-1).tolist()
        vals = [callable(v, w) for v, w in zip(flat.tolist(), other)]
    a[...] = np.asarray(vals, dtype=np.float64 if a.dtype.kind == "V" else a.dtype).reshape(a.shape).astype(a.dtype)
    self._version[0] += 1
    return self


def pin_memory(self):
    """A copy of this cpu tensor on page-locked host memory (FLAME's pinned pool), for asynchronous copies to the
    GPU; as PyTorch's, an error without CUDA or for a cuda tensor."""
    from ..memory import pinned_empty, pinned_pool
    if backend.is_cuda_array(self._data):
        raise RuntimeError("pin_memory: only cpu tensors can be pinned (this one is on cuda)")
    if not pinned_pool().backend.pinned:
        raise RuntimeError("pin_memory: page-locked memory needs CUDA, and none is available")
    out = pinned_empty(tuple(self.shape), self.dtype)
    out._data[...] = self._data
    return out


def is_pinned(t):
    from ..memory import is_pinned as pinned
    return pinned(t)


def nonzero_static(input, *, size, fill_value=-1):
    """nonzero's (n, ndim) indices cut or padded with fill_value to exactly `size` rows (a fixed shape)."""
    if size < 0:
        raise ValueError(f"nonzero_static: size must be non-negative, got {size}")
    idx = I.nonzero(input)
    n = idx.shape[0]
    if n >= size:
        return idx[:size]
    pad = idx.new_full((size - n, idx.shape[1]), fill_value)
    from .shape import cat
    return cat([idx, pad], 0)


def dim_order(self):
    """The dims from the outermost to the innermost in memory (largest stride first; ties keep dim order)."""
    strides = self.stride()
    return tuple(sorted(range(self.ndim), key=lambda d: -strides[d]))


def install(T):
    """Install the methods on Tensor (called by flame_core.ops at import)."""
    have = dict(   # methods FLAME has: their in-place forms
        absolute=E.abs, arccos=MO.acos, arccosh=MO.acosh, arcsin=MO.asin, arcsinh=MO.asinh, arctan=MO.atan,
        arctanh=MO.atanh, arctan2=MO.atan2, bitwise_and=E.bitwise_and, bitwise_or=E.bitwise_or,
        bitwise_xor=E.bitwise_xor, bitwise_not=E.bitwise_not, ceil=E.ceil, clip=E.clamp, divide=E.div, eq=E.eq,
        ne=E.ne, lt=E.lt, le=E.le, gt=E.gt, ge=E.ge, greater=E.gt, less=E.lt, erf=E.erf, fix=E.trunc,
        trunc=E.trunc, floor_divide=E.floor_divide, fmod=E.fmod, remainder=E.remainder, heaviside=MO.heaviside,
        log1p=E.log1p, logical_and=E.logical_and, logical_or=E.logical_or, logical_xor=E.logical_xor,
        logical_not=E.logical_not, multiply=E.mul, negative=E.neg, true_divide=E.true_divide)
    new = dict(    # methods new here, with their in-place forms
        greater_equal=E.ge, less_equal=E.le, not_equal=E.ne, gcd=IO.gcd, lcm=IO.lcm,
        bitwise_left_shift=IO.bitwise_left_shift, bitwise_right_shift=IO.bitwise_right_shift, ldexp=MO.ldexp,
        nextafter=MO.nextafter, addbmm=M.addbmm, addmv=M.addmv, addr=M.addr, renorm=renorm, index_put=SC.index_put,
        put=SC.put, masked_scatter=SC.masked_scatter, igamma=IG.gammainc, igammac=IG.gammaincc)
    for name, fn in {**have, **new}.items():
        if name in new:
            setattr(T, name, fn)
        setattr(T, name + "_", _inplace_of(fn))
    T.__lshift__ = IO.bitwise_left_shift
    T.__rshift__ = IO.bitwise_right_shift
    T.__rlshift__ = lambda self, other: IO.bitwise_left_shift(other, self)
    T.__rrshift__ = lambda self, other: IO.bitwise_right_shift(other, self)
    T.__ilshift__ = lambda self, other: self.bitwise_left_shift_(other)
    T.__irshift__ = lambda self, other: self.bitwise_right_shift_(other)
    T.subtract_ = lambda self, other, *, alpha=1: self.sub_(other, alpha=alpha)
    T.slice_scatter, T.select_scatter = SC.slice_scatter, SC.select_scatter
    T.diagonal_scatter = SC.diagonal_scatter
    T.logcumsumexp, T.logaddexp2, T.frexp = logcumsumexp, MO.logaddexp2, MO.frexp
    T.cov, T.corrcoef = CV.cov, CV.corrcoef
    T.mode, T.histogram, T.unique_consecutive = OS.mode, B.histogram, SO.unique_consecutive
    T.exponential_, T.geometric_, T.log_normal_ = SA.exponential_, SA.geometric_, SA.log_normal_
    T.cauchy_, T.random_ = SA.cauchy_, SA.random_
    T.fill_diagonal_ = fill_diagonal_
    T.as_strided, T.as_strided_, T.as_strided_scatter = ST.as_strided, ST.as_strided_, ST.as_strided_scatter
    T.new_empty_strided = ST.new_empty_strided
    T.squeeze_, T.unsqueeze_, T.t_, T.transpose_ = MI.squeeze_, MI.unsqueeze_, MI.t_, MI.transpose_
    T.swapaxes_ = T.swapdims_ = MI.transpose_
    T.resize_, T.resize_as_ = MI.resize_, MI.resize_as_
    T.angle = MO.angle
    T.apply_, T.map_ = apply_, map_
    T.hardshrink, T.prelu = A.hardshrink, A.prelu
    T.nonzero_static, T.dim_order = nonzero_static, dim_order
    T.i0, T.i0_ = BS.i0, _inplace_of(BS.i0)
    T.layout = property(lambda self: STRIDED)
    T.pin_memory, T.is_pinned = pin_memory, lambda self: is_pinned(self)
    T.split_with_sizes = split_with_sizes
    T.unsafe_split, T.unsafe_split_with_sizes, T.unsafe_chunk = S.split, split_with_sizes, S.chunk
    T.narrow_copy = lambda self, dim, start, length: S.narrow(self, dim, start, length).clone()
    T.argwhere = lambda self: I.nonzero(self)
    T.adjoint = lambda self: self.mT
    T.is_nonzero, T.is_signed, T.storage_offset = is_nonzero, is_signed, storage_offset
    T.is_same_size = lambda self, other: tuple(self.shape) == tuple(other.shape)
    T.is_cpu = property(lambda self: not backend.is_cuda_array(self._data))
    T.isreal = lambda self: ones_like(self, dtype=D.bool_)
    for name in ("conj", "conj_physical", "resolve_conj", "resolve_neg"):
        setattr(T, name, lambda self: self)
    T.conj_physical_ = lambda self: self
    T.is_conj = T.is_neg = lambda self: False
    T.real = property(lambda self: self)
    T.imag = property(imag)
