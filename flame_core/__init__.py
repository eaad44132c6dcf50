"""flame_core: Tensor on NumPy/CuPy arrays with tape-based autograd. Import as `import flame_core as flame`."""
# cpu_malloc sets glibc's malloc thresholds at import (flame_core/cpu_malloc.py)
from . import amp, autograd, checkpoint, cpu_malloc, cuda, distributions, errors, linalg, memory, ops, special
from .autograd import Function, enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from .device import Device, cuda_is_available, default_device, device, set_default_device
from .dtypes import (
    DType,
    bfloat16,
    bool_,
    double,
    float8_e4m3fn,
    float16,
    float32,
    float64,
    get_default_dtype,
    half,
    int8,
    int16,
    int32,
    int64,
    long,
    promote_types,
    result_type,
    set_default_dtype,
    uint8,
)
from .dtypes import bool_ as bool  # noqa: PLC0414
from .dtypes import float as float  # noqa: PLC0414  (flame.float is float32, as torch.float)
from .dtypes import int as int  # noqa: PLC0414
from .errors import AutogradError, DeviceError, DTypeError, FlameError, OutOfMemoryError, ShapeError
from .linalg import det, logdet, matrix_exp, matrix_power, pinverse, slogdet
from .linalg import inv as inverse
from .linalg.legacy import (
    cholesky,
    cholesky_inverse,
    cholesky_solve,
    lu,
    lu_solve,
    lu_unpack,
    qr,
    svd,
    triangular_solve,
)
from .memory_formats import channels_last, contiguous_format, memory_format, preserve_format
from .ops import torch_functions as _torch_functions
from .ops.activation import gelu, silu, softplus
from .ops.arrangement import (
    atleast_1d,
    atleast_2d,
    atleast_3d,
    broadcast_tensors,
    cartesian_prod,
    column_stack,
    combinations,
    diff,
    dsplit,
    dstack,
    fliplr,
    flipud,
    hsplit,
    hstack,
    meshgrid,
    rot90,
    row_stack,
    take_along_dim,
    tile,
    tril_indices,
    triu_indices,
    unravel_index,
    vander,
    vsplit,
    vstack,
)
from .ops.bessel import i0
from .ops.binning import bincount, bucketize, histc, histogram, isin, searchsorted
from .ops.covariance import corrcoef, cov
from .ops.creation import (
    arange,
    as_tensor,
    empty,
    empty_like,
    eye,
    from_numpy,
    full,
    full_like,
    linspace,
    logspace,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randn,
    randn_like,
    randperm,
    tensor,
    zeros,
    zeros_like,
)
from .ops.distance import cdist
from .ops.elementwise import (
    abs,
    add,
    allclose,
    bitwise_and,
    bitwise_not,
    bitwise_or,
    bitwise_xor,
    ceil,
    clamp,
    clamp_max,
    clamp_min,
    clip,
    cos,
    div,
    eq,
    equal,
    erf,
    exp,
    floor,
    floor_divide,
    fmod,
    ge,
    gt,
    isclose,
    isfinite,
    isinf,
    isnan,
    le,
    lerp,
    log,
    log1p,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    lt,
    maximum,
    minimum,
    mul,
    ne,
    neg,
    pow,
    reciprocal,
    relu,
    remainder,
    round,
    rsqrt,
    sigmoid,
    sign,
    sin,
    sqrt,
    square,
    sub,
    tanh,
    true_divide,
    trunc,
    where,
)
from .ops.incomplete_gamma import gammainc as igamma
from .ops.incomplete_gamma import gammaincc as igammac
from .ops.index_fill import index_copy, index_fill
from .ops.indexing import gather, index_select, masked_fill, masked_select, nonzero, one_hot, pad, scatter_add, take
from .ops.info import is_floating_point, is_tensor, numel
from .ops.integer_ops import bitwise_left_shift, bitwise_right_shift, gcd, lcm
from .ops.integration import cumulative_trapezoid, trapezoid, trapz
from .ops.linalg import bmm, dot, einsum, matmul, mm, mv, outer
from .ops.logcumsumexp import logcumsumexp
from .ops.math_ops import (
    acos,
    acosh,
    addcdiv,
    addcmul,
    angle,
    arctan2,
    asin,
    asinh,
    atan,
    atan2,
    atanh,
    copysign,
    cosh,
    deg2rad,
    erfc,
    erfinv,
    exp2,
    expm1,
    float_power,
    fmax,
    fmin,
    frac,
    frexp,
    heaviside,
    hypot,
    ldexp,
    log2,
    log10,
    logaddexp,
    logaddexp2,
    logit,
    nan_to_num,
    nextafter,
    positive,
    rad2deg,
    sgn,
    signbit,
    sinc,
    sinh,
    tan,
    xlogy,
)
from .ops.matrix import addbmm, addmm, addmv, addr, baddbmm, diag, diag_embed, diagflat, diagonal, trace
from .ops.numpy_names import NAMES as _NUMPY_NAMED
from .ops.numpy_names import with_numpy_names as _with_numpy_names
from .ops.order_stats import (
    aminmax,
    cummax,
    cummin,
    kthvalue,
    median,
    mode,
    nanmean,
    nanmedian,
    nanquantile,
    nansum,
    quantile,
)
from .ops.products import block_diag, cross, inner, kron, tensordot
from .ops.reduction import (
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    count_nonzero,
    cumprod,
    cumsum,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    norm,
    prod,
    softmax,
    std,
    std_mean,
    sum,
    var,
    var_mean,
)
from .ops.renorm import renorm
from .ops.sampling import bernoulli, multinomial, normal
from .ops.scatter import index_add, index_reduce, scatter, scatter_reduce
from .ops.scatter_copies import diagonal_scatter, index_put, masked_scatter, select_scatter, slice_scatter
from .ops.shape import (
    broadcast_shapes,
    broadcast_to,
    cat,
    chunk,
    clone,
    concat,
    concatenate,
    expand,
    flatten,
    flip,
    movedim,
    narrow,
    permute,
    ravel,
    repeat_interleave,
    reshape,
    roll,
    select,
    split,
    squeeze,
    stack,
    swapaxes,
    tensor_split,
    transpose,
    tril,
    triu,
    unbind,
    unflatten,
    unsqueeze,
)
from .ops.sorting import argsort, msort, sort, topk, unique, unique_consecutive
from .ops.special_fns import digamma, lgamma, mvlgamma, polygamma
from .ops.strided import as_strided, as_strided_scatter, empty_strided
from .ops.windows import bartlett_window, blackman_window, hamming_window, hann_window, kaiser_window
from .random import Generator, default_generator, get_rng_state, manual_seed, seed, set_rng_state
from .serialization import load, save
from .tensor import Size, Tensor
from .threads import get_num_threads, set_num_threads  # the BLAS sized at import (flame_core/threads.py)
from .type_info import finfo, iinfo

# memory (imported above) installs FLAME's pool as CuPy's allocator on a GPU (FLAME_CUDA_POOL=0 opts out) and the cpu
# storage accounting: stats, limits and OOM reports work without an explicit import
globals().update({_n: _with_numpy_names(globals()[_n]) for _n in _NUMPY_NAMED})  # axis= / keepdims=, as torch.X
globals().update({_n: getattr(_torch_functions, _n) for _n in _torch_functions.__all__})  # other names, X_ forms
autocast = amp.autocast
is_autocast_enabled, get_autocast_dtype = amp.is_autocast_enabled, amp.get_autocast_dtype
is_inference_mode_enabled = autograd.is_inference_mode_enabled


def initial_seed():
    """The seed of the default CPU generator (manual_seed's, or the one drawn at start)."""
    return default_generator("cpu").initial_seed()

__version__ = "0.1.0"


def cuda_device_count():
    from . import backend
    return backend.cuda_device_count()
