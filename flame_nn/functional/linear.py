"""linear: y = x @ W^T + b as one 2-D GEMM over all leading dimensions (cuBLAS reads W^T in place, no copy)."""
from flame_core.amp import autocast_mode as _amp
from flame_core.autograd import Function
from flame_core.errors import DTypeError, ShapeError, fmt_shape
from flame_core.ops.linalg import _mm_arrays
from flame_core.tensor import _wrap, check_same_device


class Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b):
        a = x._data
        lead = a.shape[:-1]
        y = _mm_arrays(a.reshape(-1, a.shape[-1]), w._data.T)  # (M, in) @ (in, out)
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


