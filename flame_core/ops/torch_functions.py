"""torch.X functions whose op FLAME has under another name or as a method (the other names, in-place forms such as
torch.relu_), the dtype / shape queries, and the small helpers of torch's namespace: asarray, from_dlpack,
scalar_tensor, randint_like, can_cast, rsub, dist, chain_matmul, get_default_device and the float32 matmul precision
setting."""
import numpy as np

from .. import backend
from .. import dtypes as D
from ..device import default_device
from ..errors import DeviceError, DTypeError
from ..tensor import Tensor, _wrap
from . import creation as C
from . import elementwise as E
from . import math_ops as MO
from . import shape as S
from .surface_methods import STRIDED as strided  # noqa: F401  (exported through __all__)
from .surface_methods import is_nonzero, is_signed, nonzero_static  # noqa: F401  (exported through __all__)

absolute, divide, multiply, subtract, negative = E.abs, E.div, E.mul, E.sub, E.neg
greater, greater_equal, less, less_equal, not_equal = E.gt, E.ge, E.lt, E.le, E.ne
arccos, arccosh, arcsin, arcsinh, arctan, arctanh = MO.acos, MO.acosh, MO.asin, MO.asinh, MO.atan, MO.atanh
fix, swapdims, moveaxis, t = E.trunc, S.swapdims, S.movedim, S.t


def detach(input):
    return input.detach()


def isposinf(input):
    return E.logical_and(E.isinf(input), input > 0)


def isneginf(input):
    return E.logical_and(E.isinf(input), input < 0)


def rsub(input, other, *, alpha=1):
    """other - alpha * input."""
    return E.sub(other, input, alpha=alpha)


def dist(input, other, p=2):
    """The p-norm of input - other."""
    return (input - other).norm(p)


def chain_matmul(*matrices):
    """The product of 2-D matrices in order (deprecated in PyTorch for linalg.multi_dot, which this is)."""
    from ..linalg import multi_dot
    return multi_dot(list(matrices))


def argwhere(input):
    return input.argwhere()


def adjoint(input):
    return input.adjoint()


def ger(input, vec2):
    """outer (PyTorch's older name)."""
    return input.ger(vec2)


def get_device(input):
    return input.get_device()


def fill(input, value):
    """A tensor like input filled with value (out of place)."""
    return C.full_like(input, value.item() if isinstance(value, Tensor) else value)


def frombuffer(buffer, *, dtype, count=-1, offset=0, requires_grad=False):
    """A 1-D cpu tensor over an object exposing the buffer protocol (shared, not copied), as torch.frombuffer."""
    arr = np.frombuffer(buffer, dtype=D.dtype(dtype).np, count=count, offset=offset)
    t = _wrap(arr)
    return t.requires_grad_(True) if requires_grad else t


def split_with_sizes(input, split_sizes, dim=0):
    return input.split_with_sizes(split_sizes, dim)


def narrow_copy(input, dim, start, length):
    return input.narrow_copy(dim, start, length)


def conj(input):
    return input   # real tensors: conj is the tensor itself (as PyTorch's for real dtypes)


conj_physical = resolve_conj = resolve_neg = real = conj


def imag(input):
    return input.imag


def is_complex(input):
    return False   # FLAME has no complex dtypes


def is_conj(input):
    return False


is_neg = is_conj


def is_same_size(input, other):
    return tuple(input.shape) == tuple(other.shape)


def isreal(input):
    return input.isreal()


_KIND = {"b": 0, "u": 1, "i": 1, "f": 2, "V": 2}   # bool < integers < floats (bfloat16 and fp8 are floats)


def can_cast(from_, to):
    """Whether PyTorch's casting rules allow from_ -> to in type promotion: not to a lower category (float to
    integer, integer to bool)."""
    a, b = D.dtype(from_), D.dtype(to)
    return _KIND[np.dtype(a.np).kind] <= _KIND[np.dtype(b.np).kind]


def scalar_tensor(s, *, dtype=None, device=None, requires_grad=False):
    """A 0-d tensor of the number s (the default float dtype unless dtype says otherwise)."""
    return C.tensor(float(s) if dtype is None else s, dtype=dtype or D.get_default_dtype(), device=device,
                    requires_grad=requires_grad)


def randint_like(input, low=0, high=None, *, dtype=None, device=None, generator=None):
    """randint of input's shape, dtype and device (randint_like(input, high) or (input, low, high))."""
    if high is None:
        low, high = 0, low
    out = C.randint(low, high, tuple(input.shape), generator=generator, dtype=dtype or input.dtype,
                    device=device or input.device)
    return out


def asarray(obj, *, dtype=None, device=None, copy=None, requires_grad=False):
    """A tensor over obj's memory where dtype and device allow (copy=None), always a copy (copy=True), or an error
    where a copy would be needed (copy=False), as torch.asarray."""
    if copy:
        t = C.tensor(obj.detach() if isinstance(obj, Tensor) else obj, dtype=dtype, device=device)
    else:
        t = C.as_tensor(obj, dtype=dtype, device=device)
        if copy is False and not _shares(t, obj):
            raise ValueError("asarray: copy=False, but the dtype or device asked for needs a copy")
    return t.requires_grad_(True) if requires_grad else t


def _shares(t, obj):
    src = obj._data if isinstance(obj, Tensor) else obj
    if not (isinstance(src, np.ndarray) or backend.is_cuda_array(src)):
        return False
    return backend.xp_of(t._data).may_share_memory(t._data, src) if type(src) is type(t._data) else False


def from_dlpack(ext):
    """A tensor over another library's array through DLPack, sharing its memory (a CPU array: NumPy; a CUDA array:
    CuPy)."""
    dev = ext.__dlpack_device__()[0] if hasattr(ext, "__dlpack_device__") else 1
    if dev == 1:
        try:
            return _wrap(np.from_dlpack(ext))
        except (BufferError, TypeError, RuntimeError) as e:
            raise DTypeError(f"from_dlpack: NumPy cannot take this array ({e}); bfloat16 arrays: convert to "
                             f"float32 first") from e
    if dev in (2, 3, 13):   # CUDA, CUDA host, CUDA managed
        if backend.cupy is None:
            raise DeviceError("from_dlpack: a CUDA array needs CuPy (pip install flame[cuda13])")
        return _wrap(backend.cupy.from_dlpack(ext))
    raise DeviceError(f"from_dlpack: DLPack device type {dev} is neither CPU nor CUDA")


def get_default_device():
    return default_device()


_MATMUL_PRECISION = ["highest"]


def set_float32_matmul_precision(precision):
    """PyTorch's permission for float32 matmuls to use lower-precision internal math ("highest", "high" or
    "medium"). FLAME's float32 matmuls always compute in float32 ("highest": no TF32), which every setting permits;
    the setting is kept for get_float32_matmul_precision."""
    if precision not in ("highest", "high", "medium"):
        raise ValueError(f"set_float32_matmul_precision: expected 'highest', 'high' or 'medium', got {precision!r}")
    _MATMUL_PRECISION[0] = precision


def get_float32_matmul_precision():
    return _MATMUL_PRECISION[0]


def _inplace_function(name):
    def fn(input, *args, **kwargs):
        return getattr(input, name)(*args, **kwargs)
    fn.__name__ = name
    fn.__doc__ = f"torch.{name}: Tensor.{name} (in place on input)."
    return fn


INPLACE = ("abs_", "acos_", "acosh_", "asin_", "asinh_", "atan_", "atanh_", "arccos_", "arccosh_", "arcsin_",
           "arcsinh_", "arctan_", "arctanh_", "ceil_", "clamp_", "clamp_max_", "clamp_min_", "clip_", "cos_",
           "cosh_", "deg2rad_", "erf_", "erfc_", "exp_", "exp2_", "expm1_", "fix_", "floor_", "frac_", "gcd_",
           "lcm_", "ldexp_", "log_", "log10_", "log1p_", "log2_", "logit_", "nan_to_num_", "neg_", "negative_",
           "rad2deg_", "reciprocal_", "relu_", "round_", "rsqrt_", "sigmoid_", "sin_", "sinc_", "sinh_", "sqrt_",
           "square_", "tan_", "tanh_", "trunc_", "xlogy_", "zero_", "fill_", "index_put_", "addmv_", "as_strided_",
           "conj_physical_", "detach_")
globals().update({_n: _inplace_function(_n) for _n in INPLACE})
__all__ = ("absolute divide multiply subtract negative greater greater_equal less less_equal not_equal arccos "
           "arccosh arcsin arcsinh arctan arctanh fix swapdims moveaxis t detach isposinf isneginf rsub dist "
           "chain_matmul argwhere split_with_sizes narrow_copy conj conj_physical resolve_conj resolve_neg real imag "
           "is_complex is_conj is_neg is_same_size is_nonzero is_signed isreal can_cast scalar_tensor randint_like "
           "asarray from_dlpack get_default_device set_float32_matmul_precision "
           "get_float32_matmul_precision strided nonzero_static adjoint ger get_device fill frombuffer"
           ).split() + list(INPLACE)
