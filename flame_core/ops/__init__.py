"""Tensor-level ops. Importing this package installs the Tensor methods and operators."""
from .. import tensor as _tensor_module
from ..tensor import Tensor
from . import (
    activation,
    conversion,
    creation,
    distance,
    elementwise,
    indexing,
    info,
    inplace,
    linalg,
    matrix,
    reduction,
    scatter,
    shape,
    sorting,
    surface_methods,
)
from . import activation as A
from . import elementwise as E
from . import indexing as I
from . import linalg as L
from . import reduction as R
from . import shape as S
from . import sliding as SW
from .numpy_names import NAMES as _NUMPY_NAMED
from .numpy_names import with_numpy_names


def _install():
    T = Tensor
    _tensor_module._to_op[0] = conversion.to   # Tensor.to's op, without an import per call
    # operators (the hottest entry points: the bound `apply`s are looked up once, not per call)
    add, sub, mul, div = E.Add.apply, E.Sub.apply, E.Mul.apply, E.Div.apply
    T.__add__ = lambda s, o: add(s, o, 1)
    T.__radd__ = lambda s, o: add(o, s, 1)
    T.__sub__ = lambda s, o: sub(s, o, 1)
    T.__rsub__ = lambda s, o: sub(o, s, 1)
    T.__mul__ = lambda s, o: mul(s, o)
    T.__rmul__ = lambda s, o: mul(o, s)
    T.__truediv__ = lambda s, o: div(s, o, None)
    T.__rtruediv__ = lambda s, o: div(o, s, None)
    T.__floordiv__ = lambda s, o: E.Div.apply(s, o, "floor")
    T.__rfloordiv__ = lambda s, o: E.Div.apply(o, s, "floor")
    T.__mod__ = lambda s, o: E.Remainder.apply(s, o)
    T.__rmod__ = lambda s, o: E.Remainder.apply(o, s)
    T.__pow__ = lambda s, o: E.Pow.apply(s, o)
    T.__rpow__ = lambda s, o: E.Pow.apply(o, s)
    T.__matmul__ = lambda s, o: L.matmul(s, o)
    T.__rmatmul__ = lambda s, o: L.matmul(o, s)
    T.__neg__ = E.neg
    T.__pos__ = lambda s: s
    T.__abs__ = E.abs
    T.__invert__ = E.bitwise_not
    T.__and__ = E.bitwise_and   # PyTorch's & | ^: logical on bool, bitwise on integers
    T.__or__ = E.bitwise_or
    T.__xor__ = E.bitwise_xor
    T.__rand__ = lambda s, o: E.bitwise_and(o, s)
    T.__ror__ = lambda s, o: E.bitwise_or(o, s)
    T.__rxor__ = lambda s, o: E.bitwise_xor(o, s)
    T.__eq__ = E.eq
    T.__ne__ = E.ne
    T.__lt__ = E.lt
    T.__le__ = E.le
    T.__gt__ = E.gt
    T.__ge__ = E.ge
    T.__getitem__ = I.getitem
    T.__setitem__ = I.setitem
    T.__iadd__ = lambda s, o: s.add_(o)
    T.__isub__ = lambda s, o: s.sub_(o)
    T.__imul__ = lambda s, o: s.mul_(o)
    T.__itruediv__ = lambda s, o: s.div_(o)

    # methods that take the tensor first
    plain = dict(
        add=E.add, sub=E.sub, subtract=E.sub, mul=E.mul, multiply=E.mul, div=E.div, divide=E.div,
        true_divide=E.true_divide, floor_divide=E.floor_divide, remainder=E.remainder, fmod=E.fmod, pow=E.pow,
        maximum=E.maximum, minimum=E.minimum, neg=E.neg, negative=E.neg, exp=E.exp, log=E.log, log1p=E.log1p,
        sqrt=E.sqrt, rsqrt=E.rsqrt, sin=E.sin, cos=E.cos, tanh=E.tanh, sigmoid=E.sigmoid, relu=E.relu, abs=E.abs,
        sign=E.sign, floor=E.floor, ceil=E.ceil, round=E.round, trunc=E.trunc, erf=E.erf, reciprocal=E.reciprocal,
        square=E.square, silu=A.silu, gelu=A.gelu, softplus=A.softplus, clamp=E.clamp, clip=E.clamp,
        lerp=E.lerp, eq=E.eq, ne=E.ne, lt=E.lt, le=E.le, gt=E.gt, ge=E.ge, greater=E.gt, less=E.lt,
        logical_and=E.logical_and, logical_or=E.logical_or, logical_xor=E.logical_xor,
        logical_not=E.logical_not, bitwise_and=E.bitwise_and, bitwise_or=E.bitwise_or, bitwise_xor=E.bitwise_xor,
        bitwise_not=E.bitwise_not, isnan=E.isnan, isinf=E.isinf, isfinite=E.isfinite, allclose=E.allclose,
        equal=E.equal,
        sum=R.sum, mean=R.mean, var=R.var, std=R.std, max=R.max, min=R.min, amax=R.amax, amin=R.amin,
        argmax=R.argmax, argmin=R.argmin, prod=R.prod, norm=R.norm, logsumexp=R.logsumexp, all=R.all, any=R.any,
        cumsum=R.cumsum, cumprod=R.cumprod, softmax=R.softmax, log_softmax=R.log_softmax,
        count_nonzero=R.count_nonzero,
        reshape=S.reshape, view=S.view, flatten=S.flatten, unflatten=S.unflatten, permute=S.permute,
        transpose=S.transpose, swapaxes=S.swapaxes, swapdims=S.swapdims, t=S.t, squeeze=S.squeeze,
        unsqueeze=S.unsqueeze, expand=S.expand, expand_as=S.expand_as, broadcast_to=S.broadcast_to,
        repeat=S.repeat, repeat_interleave=S.repeat_interleave, chunk=S.chunk, split=S.split,
        tensor_split=S.tensor_split, unbind=S.unbind, narrow=S.narrow, select=S.select, flip=S.flip,
        roll=S.roll, tril=S.tril, triu=S.triu, contiguous=S.contiguous, is_contiguous=S.is_contiguous,
        clone=S.clone, movedim=S.movedim, unfold=SW.unfold,
        gather=I.gather, scatter_add=I.scatter_add, index_select=I.index_select, masked_fill=I.masked_fill,
        nonzero=I.nonzero, matmul=L.matmul, mm=L.mm, bmm=L.bmm, outer=L.outer, dot=L.dot,
    )
    for name, fn in plain.items():
        setattr(T, name, with_numpy_names(fn) if name in _NUMPY_NAMED else fn)
    T.where = lambda self, condition, other: E.where(condition, self, other)
    T.view_as = lambda self, other: S.view(self, tuple(other.shape))
    T.reshape_as = lambda self, other: S.reshape(self, tuple(other.shape))
    T.new_zeros = lambda self, *size, dtype=None, device=None, requires_grad=False: creation.zeros(
        *size, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)
    T.new_ones = lambda self, *size, dtype=None, device=None, requires_grad=False: creation.ones(
        *size, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)
    T.new_full = lambda self, size, fill_value, dtype=None, device=None, requires_grad=False: creation.full(
        size, fill_value, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)
    T.new_empty = lambda self, *size, dtype=None, device=None, requires_grad=False: creation.empty(
        *size, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)
    T.new_tensor = lambda self, data, dtype=None, device=None, requires_grad=False: creation.tensor(
        data, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)

    inplace.install_methods(T, plain)
    _install_torch_names(T)
    _install_aliases(T)
    surface_methods.install(T)


def _install_aliases(T):
    """PyTorch's other names for ops FLAME has (each the same op), its dtype / device shorthands, index_fill /
    index_copy and a few in-place forms."""
    from .. import dtypes as D
    from . import index_fill as IF
    from . import promotion as PR
    from .inplace import apply_inplace
    T.absolute = E.abs
    T.fix = E.trunc
    T.moveaxis = S.movedim
    T.ravel = S.ravel
    T.take = I.take
    T.diagflat = matrix.diagflat
    T.ndimension = lambda self: self._data.ndim
    T.nelement = lambda self: self._data.size
    T.byte = lambda self: self.to(D.uint8)
    T.char = lambda self: self.to(D.int8)
    T.short = lambda self: self.to(D.int16)
    T.get_device = lambda self: -1 if self.device.type == "cpu" else self.device.index
    T.is_complex = lambda self: False   # FLAME has no complex dtypes
    T.isposinf = lambda self: E.logical_and(E.isinf(self), self > 0)
    T.isneginf = lambda self: E.logical_and(E.isinf(self), self < 0)
    T.mv = L.mv
    T.ger = L.outer
    T.vdot = L.dot
    T.H = property(S.matrix_h)
    T.mH = property(lambda self: self.mT)   # (real: the transpose of the last two dims)
    T.index_fill = IF.index_fill
    T.index_copy = IF.index_copy
    T.index_fill_ = lambda self, dim, index, value: apply_inplace(self, lambda t: IF.index_fill(t, dim, index, value))
    T.index_copy_ = lambda self, dim, index, source: apply_inplace(
        self, lambda t, s: IF.index_copy(t, dim, index, s), source)
    T.tril_ = lambda self, diagonal=0: apply_inplace(self, lambda t: S.tril(t, diagonal))
    T.triu_ = lambda self, diagonal=0: apply_inplace(self, lambda t: S.triu(t, diagonal))
    T.dist = lambda self, other, p=2: (self - other).norm(p)
    T.sum_to_size = PR.sum_to_size


def _install_torch_names(T):
    """Sorting, the scatter family, matrix helpers, Tensor.type (issue 31)."""
    from . import matrix as M
    from . import sorting as SO
    from .inplace import apply_inplace
    methods = dict(
        sort=SO.sort, argsort=SO.argsort, msort=SO.msort, topk=SO.topk, unique=SO.unique,
        masked_select=I.masked_select, isclose=E.isclose, clamp_min=E.clamp_min, clamp_max=E.clamp_max,
        addmm=M.addmm, baddbmm=M.baddbmm, diag=M.diag, diagonal=M.diagonal, diag_embed=M.diag_embed,
        trace=M.trace,
    )
    for name, fn in methods.items():
        setattr(T, name, with_numpy_names(fn) if name in _NUMPY_NAMED else fn)
    T.type = info.tensor_type
    T.clamp_min_ = lambda self, min: apply_inplace(self, lambda t: E.clamp_min(t, min))
    T.clamp_max_ = lambda self, max: apply_inplace(self, lambda t: E.clamp_max(t, max))
    T.addmm_ = lambda self, mat1, mat2, *, beta=1, alpha=1: apply_inplace(
        self, lambda t, a, b: M.addmm(t, a, b, beta=beta, alpha=alpha), mat1, mat2)
    T.baddbmm_ = lambda self, batch1, batch2, *, beta=1, alpha=1: apply_inplace(
        self, lambda t, a, b: M.baddbmm(t, a, b, beta=beta, alpha=alpha), batch1, batch2)
    T.cumsum_ = with_numpy_names(lambda self, dim, *, dtype=None: apply_inplace(
        self, lambda t: R.cumsum(t, dim, dtype=dtype)))
    T.cumprod_ = with_numpy_names(lambda self, dim, *, dtype=None: apply_inplace(
        self, lambda t: R.cumprod(t, dim, dtype=dtype)))
    scatter.install_methods(T)
    _install_math_methods(T)


def _install_math_methods(T):
    """The math functions, order statistics, arranging helpers and draws of PyTorch's Tensor methods (issue 48's
    PyTorch surface: math_ops, order_stats, arrangement, products, binning, sampling)."""
    from . import arrangement as AR
    from . import binning as B
    from . import math_ops as MO
    from . import order_stats as OS
    from . import products as P
    from . import sampling as SA
    from . import special_fns as SF
    from .inplace import apply_inplace
    methods = dict(
        tan=MO.tan, asin=MO.asin, acos=MO.acos, atan=MO.atan, arcsin=MO.asin, arccos=MO.acos, arctan=MO.atan,
        sinh=MO.sinh, cosh=MO.cosh, asinh=MO.asinh, acosh=MO.acosh, atanh=MO.atanh, arcsinh=MO.asinh,
        arccosh=MO.acosh, arctanh=MO.atanh, expm1=MO.expm1, exp2=MO.exp2, log2=MO.log2, log10=MO.log10,
        erfc=MO.erfc, erfinv=MO.erfinv, logit=MO.logit, sinc=MO.sinc, nan_to_num=MO.nan_to_num, frac=MO.frac,
        deg2rad=MO.deg2rad, rad2deg=MO.rad2deg, sgn=MO.sgn, signbit=MO.signbit, positive=MO.positive,
        atan2=MO.atan2, arctan2=MO.atan2, hypot=MO.hypot, xlogy=MO.xlogy, logaddexp=MO.logaddexp,
        copysign=MO.copysign, fmax=MO.fmax, fmin=MO.fmin, float_power=MO.float_power, heaviside=MO.heaviside,
        addcmul=MO.addcmul, addcdiv=MO.addcdiv,
        median=OS.median, nanmedian=OS.nanmedian, quantile=OS.quantile, nanquantile=OS.nanquantile,
        kthvalue=OS.kthvalue, cummax=OS.cummax, cummin=OS.cummin, aminmax=OS.aminmax, nansum=OS.nansum,
        nanmean=OS.nanmean, var_mean=R.var_mean,
        diff=AR.diff, tile=AR.tile, fliplr=AR.fliplr, flipud=AR.flipud, rot90=AR.rot90, hsplit=AR.hsplit,
        vsplit=AR.vsplit, dsplit=AR.dsplit, take_along_dim=AR.take_along_dim,
        kron=P.kron, inner=P.inner, cross=P.cross,
        bincount=B.bincount, histc=B.histc, isin=B.isin,
        bernoulli=SA.bernoulli, multinomial=SA.multinomial,
        lgamma=SF.lgamma, digamma=SF.digamma, polygamma=lambda self, n: SF.polygamma(n, self), mvlgamma=SF.mvlgamma,
    )
    for name, fn in methods.items():
        setattr(T, name, with_numpy_names(fn) if name in _NUMPY_NAMED else fn)
    for name in ("tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "expm1", "exp2",
                 "log2", "log10", "erfc", "erfinv", "sinc", "frac", "deg2rad", "rad2deg", "sgn", "lgamma", "digamma"):
        setattr(T, name + "_", (lambda f: lambda self: apply_inplace(self, f))(methods[name]))
    T.polygamma_ = lambda self, n: apply_inplace(self, lambda t: SF.polygamma(n, t))
    T.mvlgamma_ = lambda self, p: apply_inplace(self, lambda t: SF.mvlgamma(t, p))
    T.logit_ = lambda self, eps=None: apply_inplace(self, lambda t: MO.logit(t, eps))
    T.nan_to_num_ = lambda self, nan=0.0, posinf=None, neginf=None: apply_inplace(
        self, lambda t: MO.nan_to_num(t, nan, posinf, neginf))
    T.atan2_ = lambda self, other: apply_inplace(self, MO.atan2, other)
    T.hypot_ = lambda self, other: apply_inplace(self, MO.hypot, other)
    T.xlogy_ = lambda self, other: apply_inplace(self, MO.xlogy, other)
    T.copysign_ = lambda self, other: apply_inplace(self, MO.copysign, other)
    T.float_power_ = lambda self, exponent: apply_inplace(self, MO.float_power, exponent)
    T.addcmul_ = lambda self, tensor1, tensor2, *, value=1: apply_inplace(
        self, lambda t, a, b: MO.addcmul(t, a, b, value=value), tensor1, tensor2)
    T.addcdiv_ = lambda self, tensor1, tensor2, *, value=1: apply_inplace(
        self, lambda t, a, b: MO.addcdiv(t, a, b, value=value), tensor1, tensor2)
    T.bernoulli_ = SA.bernoulli_


_install()
