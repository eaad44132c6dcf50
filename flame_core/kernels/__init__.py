"""Raw CUDA kernels (cuda_src/*.cu) behind array-level families.

Families (`activations`, `softmax`, `norms`, `groupnorm`, `modulate`, `rope`, `adamw`, `fp8`, ...) take and return
NumPy or CuPy arrays. On CuPy arrays of float32/float16/bfloat16 with kernels `enabled()` they launch the raw kernel;
otherwise they run the reference written against `xp`, which is also the test oracle. `FLAME_KERNELS=0` or
`with reference():` forces it. Inside the package: `loader` compiles and caches, `launching` launches, `plans` sizes
grids, `column_sum` sums partial rows, `precompile` warms CuPy's disk cache.

The public launch API (this module) is what code above flame_core uses to write a fused op: a `Function` whose
forward allocates its outputs (`flame.empty_like`, ...) and launches a kernel on Tensors::

    from flame_core import kernels
    if kernels.use_kernel(x):
        y = flame.empty_like(x)
        k = kernels.get_function("activations", "silu_fwd<{T}, 1>", x.dtype)
        kernels.launch(k, kernels.grid_1d(x.numel(), 256), (256,), (x, y, kernels.i64(x.numel())))
"""
from . import launching as _launching
from . import loader as _loader
from .launching import PackedLaunch, f32, i32, i64, null
from .loader import ctype, enabled, load_module, reference
from .plans import cdiv, grid_1d

__all__ = ["cdiv", "ctype", "enabled", "f32", "get_function", "grid_1d", "i32", "i64", "launch", "load_module", "null",
           "PackedLaunch", "reference", "use_kernel"]


def _array(a):
    """A Tensor's storage array (a contiguous tensor's data pointer is what a kernel reads); anything else as is."""
    data = getattr(a, "_data", None)
    return a if data is None else data


def use_kernel(*tensors):
    """True when every argument (Tensors, arrays or None) is a cuda tensor / CuPy array of float32, float16 or bfloat16
    and kernels are enabled: the raw kernel may run; otherwise the caller takes its reference path."""
    return _loader.use_kernel(*(_array(t) for t in tensors))


def get_function(stem, kernel_name, dtype=None):
    """The kernel `kernel_name` of cuda_src/<stem>.cu, instantiated for `dtype` (a flame dtype or a NumPy dtype; see
    `loader.get_function` for template names)."""
    np_dtype = getattr(dtype, "np", None)
    return _loader.get_function(stem, kernel_name, dtype if np_dtype is None else np_dtype)


def launch(kernel, grid, block, args, shared_mem=0, stream=None):
    """Launch `kernel` on `grid` x `block`; `args` holds Tensors (their storage is passed), CuPy arrays and scalars
    of the C parameter types (`i32`, `i64`, `f32`, `null`)."""
    _launching.launch(kernel, grid, block, tuple(_array(a) for a in args), shared_mem, stream)
