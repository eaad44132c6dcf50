"""flame_core.linalg: PyTorch's torch.linalg names and signatures, differentiable.

norm, vector_norm, matrix_norm (norms.py); solve, inv (solve.py); svd, svdvals (svd.py). The cpu runs NumPy's
LAPACK (numpy.linalg); cuda runs CuPy's cuSOLVER wrappers (cupy.linalg.solve / inv / svd) under
`cupyx.errstate(linalg="raise")`, so a singular matrix raises `LinAlgError` on both, as in PyTorch (that check
waits for the device). float32 and float64 only, as PyTorch's CPU kernels; cast 16-bit tensors with .float().
"""
from ..ops.numpy_names import with_numpy_names as _np_names
from ._common import LinAlgError
from .norms import matrix_norm, norm, vector_norm
from .solve import inv, solve
from .svd import svd, svdvals

# C++-bound in PyTorch, so they take axis= / keepdims= too (see flame_core/ops/numpy_names.py)
norm, vector_norm, matrix_norm = _np_names(norm), _np_names(vector_norm), _np_names(matrix_norm)

__all__ = ["LinAlgError", "norm", "vector_norm", "matrix_norm", "solve", "inv", "svd", "svdvals"]
