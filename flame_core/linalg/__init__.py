"""flame_core.linalg: PyTorch's torch.linalg names and signatures, differentiable.

norm, vector_norm, matrix_norm (norms.py); solve, inv (solve.py); svd, svdvals (svd.py); det, slogdet (det.py);
cholesky (cholesky.py); qr (qr.py); eigh, eigvalsh (eigh.py); matrix_power, multi_dot, vecdot, cross, diagonal, pinv,
matrix_rank, solve_triangular (matrix_functions.py, composed of the others). The cpu runs NumPy's
LAPACK (numpy.linalg); cuda runs CuPy's cuSOLVER wrappers (cupy.linalg.solve / inv / svd / ...) under
`cupyx.errstate(linalg="raise")`, so a singular matrix raises `LinAlgError` on both, as in PyTorch (that check
waits for the device). float32 and float64 only, as PyTorch's CPU kernels; cast 16-bit tensors with .float().
"""
from ..ops.linalg import matmul
from ..ops.numpy_names import with_numpy_names as _np_names
from ._common import LinAlgError
from .checked import cholesky_ex, inv_ex, solve_ex
from .cholesky import cholesky
from .det import det, logdet, slogdet
from .eigh import eigh, eigvalsh
from .lstsq import lstsq
from .lu import lu, lu_factor, lu_factor_ex, lu_solve
from .matrix_exp import matrix_exp
from .matrix_functions import (
    cond,
    cross,
    diagonal,
    matrix_power,
    matrix_rank,
    multi_dot,
    pinv,
    pinverse,
    solve_triangular,
    tensorinv,
    tensorsolve,
    vander,
    vecdot,
)
from .norms import matrix_norm, norm, vector_norm
from .qr import qr
from .solve import inv, solve
from .svd import svd, svdvals

# C++-bound in PyTorch, so they take axis= / keepdims= too (see flame_core/ops/numpy_names.py)
norm, vector_norm, matrix_norm = _np_names(norm), _np_names(vector_norm), _np_names(matrix_norm)

__all__ = ["LinAlgError", "norm", "vector_norm", "matrix_norm", "solve", "inv", "svd", "svdvals", "det", "slogdet",
           "cholesky", "qr", "eigh", "eigvalsh", "matrix_power", "multi_dot", "vecdot", "cross", "diagonal", "pinv",
           "matrix_rank", "solve_triangular", "matrix_exp", "matmul", "cholesky_ex", "inv_ex", "solve_ex", "lstsq",
           "lu", "lu_factor", "lu_factor_ex", "lu_solve", "cond", "tensorinv", "tensorsolve", "vander"]


def _install_methods():
    """Tensor.det / logdet / slogdet / inverse / pinverse / matrix_power / matrix_exp and the older svd / qr /
    cholesky / cholesky_solve / cholesky_inverse / triangular_solve (legacy.py), as PyTorch's."""
    from ..tensor import Tensor
    from . import legacy as LG
    Tensor.det, Tensor.logdet, Tensor.slogdet = det, logdet, slogdet
    Tensor.inverse, Tensor.pinverse, Tensor.matrix_power = inv, pinverse, matrix_power
    Tensor.matrix_exp = matrix_exp
    Tensor.svd, Tensor.qr, Tensor.cholesky = LG.svd, LG.qr, LG.cholesky
    Tensor.cholesky_solve, Tensor.cholesky_inverse = LG.cholesky_solve, LG.cholesky_inverse
    Tensor.triangular_solve = LG.triangular_solve
    Tensor.lu, Tensor.lu_solve = LG.lu, LG.lu_solve


_install_methods()
