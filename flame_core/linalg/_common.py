"""What the linalg functions share: the error type, input checks, and running a LAPACK / cuSOLVER call so that a
singular matrix raises on both backends."""
import contextlib

import numpy as np

from .. import backend
from .. import dtypes as D
from ..errors import DTypeError, FlameError, ShapeError, fmt_shape
from ..tensor import Tensor

_LAPACK = (D.float32, D.float64)


class LinAlgError(FlameError, RuntimeError):
    """A matrix the decomposition cannot handle (singular for solve / inv, no convergence for svd), as
    torch.linalg.LinAlgError."""


def check_matrix(op, A, square=False):
    """A is a float32 / float64 Tensor of shape (..., m, n) (square: m == n)."""
    if not isinstance(A, Tensor):
        raise TypeError(f"linalg.{op}: expected a Tensor, got {type(A).__name__}")
    if A.dtype not in _LAPACK:
        raise DTypeError(f"linalg.{op}: supports float32 and float64, got {A.dtype.name} (cast with .float() or "
                         f".double())")
    if A.ndim < 2:
        raise ShapeError(f"linalg.{op}: expected a tensor with at least 2 dims (..., m, n), got shape "
                         f"{fmt_shape(A.shape)}")
    if square and A.shape[-1] != A.shape[-2]:
        raise ShapeError(f"linalg.{op}: expected a batch of square matrices, got shape {fmt_shape(A.shape)}")


@contextlib.contextmanager
def lapack_errors(op, shape, meaning):
    """Raise LinAlgError for what NumPy / CuPy report (CuPy only checks under errstate(linalg="raise")), saying
    what it means (`meaning`: CuPy's message only gives cuSOLVER's status code)."""
    ctx = contextlib.nullcontext()
    if backend.cupy is not None:
        try:
            import cupyx
            ctx = cupyx.errstate(linalg="raise")
        except ImportError:
            pass
    try:
        with ctx:
            yield
    except np.linalg.LinAlgError as e:
        raise LinAlgError(f"linalg.{op}: {meaning} (input of shape {fmt_shape(shape)}; {e})") from e
