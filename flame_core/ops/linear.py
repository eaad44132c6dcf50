"""linear: y = x @ W^T + b as one 2-D GEMM over all leading dimensions (cuBLAS reads W^T in place, no copy), and
linear_cat2: linear(cat((a, b), -1), W, b) without building the concatenation."""
from .. import backend
from ..amp import autocast_mode as _amp
from ..autograd.function import Function
from ..errors import DTypeError, ShapeError, fmt_shape
from ..kernels import gemm as _cublas
from ..tensor import _wrap, check_same_device
from .linalg import mm_arrays
from .shape import cat


class Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b):
        a = x._data
        lead = a.shape[:-1]
        y = mm_arrays(a.reshape(-1, a.shape[-1]), w._data.T)  # (M, in) @ (in, out)
        if b is not None:
            y += b._data
        # keep only what the wanted gradients use (as PyTorch): a frozen weight's Linear keeps no input
        nx, nw, _ = ctx.needs_input_grad
        ctx.save_for_backward(x if nw else None, w if nx else None)
        ctx.x_shape = x.shape
        return _wrap(y.reshape(lead + (w._data.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        # Tensor ops: runs without recording normally, and builds a graph under create_graph (double backward)
        x, w = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (M, out)
        dx = (g2 @ w).reshape(ctx.x_shape) if nx else None
        dw = g2.mT @ x.reshape(-1, x.shape[-1]) if nw else None
        db = g2.sum(0) if nb else None
        return dx, dw, db


def linear(input, weight, bias=None):
    """PyTorch's F.linear: input (*, in), weight (out, in), bias (out,) -> (*, out)."""
    check_same_device("linear", input, weight, bias)
    if weight.ndim != 2 or input.ndim < 1 or input.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: input {fmt_shape(input.shape)} and weight {fmt_shape(weight.shape)} do not fit "
                         f"(expected weight (out_features, {input.shape[-1] if input.ndim else '?'}))")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ShapeError(f"linear: bias {fmt_shape(bias.shape)} for {weight.shape[0]} output features")
    if _amp.active:
        input, weight, bias = _amp.cast_inputs("lower", input, weight, bias)
    if input.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise DTypeError(f"linear: input ({input.dtype}), weight ({weight.dtype})"
                         + (f" and bias ({bias.dtype})" if bias is not None else "")
                         + " must have the same dtype (cast them, or use flame.amp.autocast)")
    if not input.dtype.is_floating_point:
        raise DTypeError(f"linear: expected floating point tensors, got {input.dtype}")
    return Linear.apply(input, weight, bias)


class LinearCat2(Function):
    """linear(cat((a, b), -1), w, bias) without building the concatenation: a @ w[:, :Ha]^T, then b @ w[:, Ha:]^T
    accumulated into the same output by the second GEMM (cuBLAS beta = 1), then the bias. Backward: the two input
    gradients come out separately (no split of a concatenated gradient)."""

    @staticmethod
    def forward(ctx, a, b, w, bias):
        ha = a.shape[-1]
        lead = a.shape[:-1]
        a2 = a._data.reshape(-1, ha)
        b2 = b._data.reshape(-1, b.shape[-1])
        wd = w._data
        if backend.is_cuda_array(wd) and _cublas.supported(wd.dtype) and a2.dtype == b2.dtype == wd.dtype:
            y = _cublas.matmul(a2, wd[:, :ha].T)
            _cublas.matmul(b2, wd[:, ha:].T, out=y, beta=1.0)
        else:
            y = mm_arrays(a2, wd[:, :ha].T)
            y += mm_arrays(b2, wd[:, ha:].T)
        if bias is not None:
            y += bias._data
        na, nb, nw, _ = ctx.needs_input_grad
        # the inputs only for the weight's gradient (a frozen weight keeps neither), the weight for theirs
        ctx.save_for_backward(a if nw else None, b if nw else None, w if (na or nb) else None)
        ctx.shapes = (a.shape, b.shape)
        return _wrap(y.reshape(lead + (wd.shape[0],)))

    @staticmethod
    def backward(ctx, g):
        a, b, w = ctx.saved_tensors
        na, nb, nw, nbias = ctx.needs_input_grad
        sa, sb = ctx.shapes
        ha = sa[-1]
        g2 = g.reshape(-1, g.shape[-1])
        da = (g2 @ w[:, :ha]).reshape(sa) if na else None
        db = (g2 @ w[:, ha:]).reshape(sb) if nb else None
        dw = None
        if nw:
            dw = cat((g2.mT @ a.reshape(-1, ha), g2.mT @ b.reshape(-1, b.shape[-1])), dim=1)
        dbias = g2.sum(0) if nbias else None
        return da, db, dw, dbias


def linear_cat2(a, b, weight, bias=None):
    """linear(cat((a, b), -1), weight, bias) as one fused op (see LinearCat2); autocast-aware like linear."""
    if _amp.active:
        a, b, weight, bias = _amp.cast_inputs("lower", a, b, weight, bias)
    if a.shape[:-1] != b.shape[:-1] or a.shape[-1] + b.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear_cat2: inputs {tuple(a.shape)} and {tuple(b.shape)} do not fit a weight of shape "
                         f"{tuple(weight.shape)}")
    return LinearCat2.apply(a, b, weight, bias)
