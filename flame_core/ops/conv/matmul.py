"""The GEMM every array path of conv2d calls."""
import numpy as np

from ... import backend
from ... import threads as _threads
from ...kernels import gemm as _gemm
from .planning import HALF


def mm(a, b, out=None):
    """a @ b (2-D or batched) into `out`; NumPy half types multiply in float32. CuPy float32/float16/bfloat16 go
    through flame_core.kernels.gemm (cuBLAS on the current stream): CuPy's own matmul refuses to run while a CUDA
    graph is being captured, and a graphed training step convolves (SDXL's UNet)."""
    xp = backend.xp_of(a)
    if xp is np and a.dtype in HALF:
        r = _threads.matmul(a.astype(np.float32), b.astype(np.float32))
        if out is None:
            return r.astype(a.dtype)
        out[...] = r
        return out
    if xp is np:
        return _threads.matmul(a, b, out=out)
    if a.dtype == b.dtype and _gemm.supported(a.dtype):
        return _gemm.matmul(a, b, out=out)
    if out is None:  # float64 (not capturable; training runs in float32 or lower)
        return xp.matmul(a, b)
    return xp.matmul(a, b, out=out)
