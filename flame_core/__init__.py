"""flame_core: Tensor on NumPy/CuPy arrays with tape-based autograd. Import as `import flame_core as flame`."""
from . import errors
from .errors import FlameError, ShapeError, DTypeError, DeviceError, AutogradError, OutOfMemoryError
from .dtypes import (DType, bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64,
                     float8_e4m3fn, half, double, long, get_default_dtype, set_default_dtype, promote_types,
                     result_type)
from .dtypes import float as float  # noqa: PLC0414  (flame.float is float32, as torch.float)
from .dtypes import int as int  # noqa: PLC0414
from .dtypes import bool_ as bool  # noqa: PLC0414
from .device import Device, device, default_device, set_default_device, cuda_is_available
from .tensor import Tensor, Size
from .memory_formats import memory_format, contiguous_format, channels_last, preserve_format
from . import autograd
from .autograd import no_grad, enable_grad, set_grad_enabled, inference_mode, is_grad_enabled, Function
from . import ops
from .ops.creation import (tensor, as_tensor, from_numpy, zeros, ones, full, empty, arange, linspace, eye, randn,
                           rand, randint, randperm, zeros_like, ones_like, full_like, randn_like, rand_like,
                           empty_like)
from .ops.elementwise import (add, sub, mul, div, true_divide, floor_divide, remainder, fmod, pow, maximum,
                              minimum, neg, exp, log, log1p, sqrt, rsqrt, sin, cos, tanh, sigmoid, relu, abs, sign,
                              floor, ceil, round, trunc, erf, reciprocal, square, clamp, clip, where, lerp, eq, ne,
                              lt, le, gt, ge, logical_and, logical_or, logical_xor, logical_not, isnan, isinf,
                              isfinite, allclose, equal)
from .ops.activation import silu, gelu, softplus
from .ops.reduction import (sum, mean, var, std, var_mean, max, min, amax, amin, argmax, argmin, prod, norm,
                            logsumexp, all, any, cumsum, cumprod, softmax, log_softmax, count_nonzero)
from .ops.shape import (reshape, flatten, unflatten, permute, transpose, swapaxes, squeeze, unsqueeze, expand,
                        broadcast_to, broadcast_shapes, repeat_interleave, chunk, split, tensor_split, unbind,
                        narrow, select, flip, roll, tril, triu, cat, concat, concatenate, stack, movedim, clone)
from .ops.indexing import gather, scatter_add, index_select, masked_fill, nonzero, pad, one_hot
from .ops.linalg import matmul, mm, bmm, outer, dot, einsum
from .ops.sorting import sort, argsort, msort, topk, unique
from .ops.indexing import masked_select
from .ops.elementwise import isclose, clamp_min, clamp_max
from .ops.scatter import scatter, scatter_reduce, index_add
from .ops.matrix import addmm, baddbmm, diag, diagonal, diag_embed, trace
from .ops.distance import cdist
from .ops.info import is_tensor, numel
from .ops.numpy_names import NAMES as _NUMPY_NAMED, with_numpy_names as _with_numpy_names
globals().update({_n: _with_numpy_names(globals()[_n]) for _n in _NUMPY_NAMED})  # axis= / keepdims=, as torch.X
from . import linalg
from .serialization import save, load
from . import amp
from . import checkpoint
from . import cuda
from . import memory  # installs FLAME's pool as CuPy's allocator on a GPU (FLAME_CUDA_POOL=0 opts out) and the
                      # cpu storage accounting: stats, limits and OOM reports work without an explicit import
from .random import Generator, manual_seed, seed, get_rng_state, set_rng_state, default_generator
from .threads import get_num_threads, set_num_threads  # the BLAS sized at import (flame_core/threads.py)

__version__ = "0.1.0"


def cuda_device_count():
    from . import backend
    return backend.cuda_device_count()
