"""GELU(tanh) of a column block of a wider row-major matrix, written contiguous (kernel: cuda_src/gelu_rows.cu).

    gelu_tanh_rows_forward(x)        x: 2-D view (rows, cols) with unit column stride -> y (rows, cols) contiguous
    gelu_tanh_rows_backward(dy, x, out=None)   -> dx (rows, cols) contiguous; out=dy writes it over dy

Flux's single-stream block applies GELU to the MLP half of linear1's output: reading that half in place saves the
copy that a contiguous-input kernel needs. The reference (and non-CUDA path) is flame_core.kernels.activations'.
"""
from .. import backend
from . import activations as _act
from . import launching as KL
from . import loader as L
from . import plans as P


def strided_rows(x):
    """(ldx) when x is a 2-D row-major view (unit column stride, 16-bit or 32-bit floats on cuda), else None."""
    if x.ndim != 2 or not L.use_kernel(x) or x.size == 0:
        return None
    item = x.itemsize
    if x.strides[1] != item or x.strides[0] % item or x.strides[0] // item < x.shape[1]:
        return None
    return x.strides[0] // item


def gelu_tanh_rows_forward(x):
    ldx = strided_rows(x)
    if ldx is None:
        return _act.gelu_forward(P.contiguous(x) if L.use_kernel(x) else x, "tanh")
    rows, cols = x.shape
    y = backend.xp_of(x).empty((rows, cols), dtype=x.dtype)
    grid, block = P.rows_grid(rows)
    KL.launch(L.get_function("gelu_rows", "gelu_rows_fwd", x.dtype), grid, block,
              (x, KL.i64(ldx), y, KL.i64(rows), KL.i32(cols)))
    return y


def gelu_tanh_rows_backward(dy, x, out=None):
    """out: None, or dy itself (contiguous, x's dtype) to write the gradient over dy (each element is read before
    it is written, by the same thread)."""
    if dy.shape != x.shape:
        raise ValueError(f"gelu_tanh_rows_backward: gradient shape {dy.shape} differs from input shape {x.shape}")
    if out is not None and (out is not dy or dy.dtype != x.dtype or not dy.flags.c_contiguous):
        raise ValueError("gelu_tanh_rows_backward: out must be dy itself, contiguous, of x's dtype "
                         f"(got {out.dtype} {out.shape} for dy {dy.dtype} {dy.shape}, x {x.dtype})")
    ldx = strided_rows(x)
    if ldx is None:
        dx = _act.gelu_backward(dy, P.contiguous(x) if L.use_kernel(x) else x, "tanh")
        if out is None:
            return dx
        out[...] = dx
        return out
    rows, cols = x.shape
    dy = P.contiguous(dy.astype(x.dtype, copy=False))
    dx = out if out is not None else backend.xp_of(x).empty((rows, cols), dtype=x.dtype)
    grid, block = P.rows_grid(rows)
    KL.launch(L.get_function("gelu_rows", "gelu_rows_bwd", x.dtype), grid, block,
              (x, KL.i64(ldx), dy, dx, KL.i64(rows), KL.i32(cols)))
    return dx
