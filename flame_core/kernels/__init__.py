"""Raw CUDA kernels (cuda_src/*.cu) behind array-level families; see `loader` for the API other code uses.

Families (`activations`, `softmax`, `norms`, `modulate`, `rope`, `adamw`, `fp8`) take and return NumPy or CuPy arrays.
On CuPy arrays of float32/float16/bfloat16 with kernels `enabled()` they launch the raw kernel; otherwise they run the
reference written against `xp`, which is also the test oracle. `FLAME_KERNELS=0` or `with reference():` forces it.
"""
from .loader import cdiv, ctype, enabled, get_function, grid_1d, launch, load_module, reference, use_kernel

__all__ = ["cdiv", "ctype", "enabled", "get_function", "grid_1d", "launch", "load_module", "reference", "use_kernel"]
