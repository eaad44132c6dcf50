"""conv_transpose2d (PyTorch's F.conv_transpose2d): the adjoint of conv2d, computed by conv2d's own machinery.

A transposed convolution of x (N, Cin, H, W) with weight (Cin, Cout/groups, KH, KW) is the gradient of
conv2d(y, weight) with respect to y, for an output gradient x, where y has the transposed output's shape
(N, Cout, OH, OW), OH = (H - 1) * stride - 2 * padding + dilation * (KH - 1) + output_padding + 1. So
    forward     y  = conv2d input-gradient(x)          (col2im / the implicit GEMM's dX path)
    backward    dx = conv2d(dy, weight)                 (a plain forward convolution)
                dw = conv2d weight-gradient(input dy, output gradient x)
"""
from ..autograd.function import Function
from ..autograd.grad_mode import state
from ..errors import AutogradError, ShapeError, fmt_shape
from ..tensor import _wrap
from .conv import bias_grad, checked_inputs, conv2d_backward, conv2d_forward, geometry, pair
from .indexing import pad


class ConvTranspose2d(Function):
    @staticmethod
    def forward(ctx, x, w, b, g):
        xa = x._data
        xp = x._xp()
        shape_of_y = xp.empty((g.N, g.C, g.H, g.W), dtype=xa.dtype)  # only its shape and dtype are read
        y, _ = conv2d_backward(xa, shape_of_y, w._data, g, need_x=True, need_w=False)
        del shape_of_y
        if b is not None:
            y += b._data.reshape(1, -1, 1, 1)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        ctx.g = g
        return _wrap(y)

    @staticmethod
    def backward(ctx, gy):
        if state.enabled:
            raise AutogradError("conv_transpose2d has no double backward (its backward runs on raw arrays)")
        x, w = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        g = ctx.g
        gya = gy._data
        dx = _wrap(conv2d_forward(gya, w._data, g)) if nx else None
        dw = _wrap(conv2d_backward(x._data, gya, w._data, g, need_x=False, need_w=True)[1]) if nw else None
        db = _wrap(bias_grad(gya)) if nb else None
        return dx, dw, db, None


def _transposed_size(n, k, s, p, d, op):
    return (n - 1) * s - 2 * p + d * (k - 1) + op + 1


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """input (N, Cin, H, W) or (Cin, H, W), weight (Cin, Cout/groups, KH, KW) -> (N, Cout, OH, OW)."""
    input, weight, bias, unbatched = checked_inputs("conv_transpose2d", input, weight, bias)
    if input.ndim != 4 or weight.ndim != 4:
        raise ShapeError(f"conv_transpose2d expects input (N, Cin, H, W) and weight (Cin, Cout/groups, KH, KW), got "
                         f"{fmt_shape(input.shape)} and {fmt_shape(weight.shape)}")
    N, Cin, H, W = input.shape
    if weight.shape[0] != Cin:
        raise ShapeError(f"conv_transpose2d: weight {fmt_shape(weight.shape)} expects {weight.shape[0]} input "
                         f"channels, the input {fmt_shape(input.shape)} has {Cin}")
    groups = int(groups)
    if groups < 1 or Cin % groups:
        raise ShapeError(f"conv_transpose2d: groups={groups} must divide the input channels {Cin}")
    (sh, sw), (ph, pw) = pair(stride, "stride"), pair(padding, "padding")
    (oph, opw), (dh, dw) = pair(output_padding, "output_padding"), pair(dilation, "dilation")
    if min(sh, sw, dh, dw) < 1 or min(ph, pw, oph, opw) < 0:
        raise ValueError(f"conv_transpose2d: stride {sh, sw} and dilation {dh, dw} must be >= 1, padding {ph, pw} "
                         f"and output_padding {oph, opw} >= 0")
    if oph >= max(sh, dh) or opw >= max(sw, dw):
        raise ValueError(f"conv_transpose2d: output padding {oph, opw} must be smaller than either stride "
                         f"{sh, sw} or dilation {dh, dw}")
    KH, KW = weight.shape[2:]
    Cout = weight.shape[1] * groups
    OH = _transposed_size(H, KH, sh, ph, dh, oph)
    OW = _transposed_size(W, KW, sw, pw, dw, opw)
    if OH < 1 or OW < 1:
        raise ShapeError(f"conv_transpose2d: input {fmt_shape(input.shape)} gives a non-positive output size "
                         f"{(OH, OW)} (padding {ph, pw} too large)")
    if bias is not None and tuple(bias.shape) != (Cout,):
        raise ShapeError(f"conv_transpose2d: bias of shape {fmt_shape(bias.shape)} for {Cout} output channels")
    # the conv2d whose input-gradient this is: input (N, Cout, OH, OW), weight (Cin, Cout/groups, KH, KW). An
    # output_padding of a stride or more (allowed under dilation) gives that conv2d output_padding // stride more
    # rows / columns than the input has: they are zeros here (nothing of the input reaches those output pixels)
    eh, ew = oph // sh, opw // sw
    if eh or ew:
        input = pad(input, (0, ew, 0, eh))
    g = geometry((N, Cout, OH, OW), tuple(weight.shape), (sh, sw), (ph, pw), (dh, dw), groups)
    if (g.OH, g.OW) != (H + eh, W + ew):
        raise ShapeError(f"conv_transpose2d: internal geometry mismatch {(g.OH, g.OW)} vs {(H + eh, W + ew)}")
    y = ConvTranspose2d.apply(input, weight, bias, g)
    return y.squeeze(0) if unbatched else y
