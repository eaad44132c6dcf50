"""The autograd node and the public entry points: conv2d, conv2d_add, pad_conv2d (PyTorch's F.conv2d semantics and
checks) and conv2d_memory_format."""
from ... import memory_formats as MF
from ...amp import autocast_mode as _amp  # autocast hook: a flag test when off
from ...autograd.function import Function
from ...autograd.grad_mode import state
from ...errors import AutogradError, DTypeError, ShapeError, fmt_shape
from ...tensor import _wrap, check_same_device
from .dispatch import bias_grad, conv2d_backward, conv2d_forward, image_bias_grad
from .planning import geometry, pair
from .routing import use_igemm


class Conv2d(Function):
    """y = conv(x, w) (+ b[o]) (+ e[n, o]) (+ r): conv2d and pad_conv2d (e, r None) and conv2d_add."""
    @staticmethod
    def forward(ctx, x, w, b, e, r, g):
        d = (lambda t: None if t is None else t._data)
        y = conv2d_forward(x._data, w._data, g, d(b), d(e), d(r))
        ctx.save_for_backward(x, w)
        ctx.g = g
        return _wrap(y)

    @staticmethod
    def backward(ctx, gy):
        if state.enabled:
            raise AutogradError("conv2d has no double backward (its backward runs on raw arrays); "
                                "create_graph=True through a convolution is not supported")
        x, w = ctx.saved_tensors
        nx, nw, nb, ne, nr = ctx.needs_input_grad[:5]
        dx, dw = conv2d_backward(gy._data, x._data, w._data, ctx.g, need_x=nx, need_w=nw)
        db = bias_grad(gy._data) if nb else None
        de = image_bias_grad(gy._data) if ne else None
        w_ = (lambda a: None if a is None else _wrap(a))
        return w_(dx), w_(dw), w_(db), w_(de), (gy if nr else None), None


def _same_padding(x, w, stride, dilation):
    """PyTorch's padding='same' (stride 1): total padding d*(k-1); the odd extra pixel goes right/bottom."""
    if pair(stride, "stride") != (1, 1):
        raise ValueError("conv2d: padding='same' is only supported with stride 1")
    dh, dw = pair(dilation, "dilation")
    th, tw = dh * (w.shape[2] - 1), dw * (w.shape[3] - 1)
    lo = (th // 2, tw // 2)
    if th % 2 or tw % 2:
        from ..indexing import pad
        x = pad(x, (tw // 2, tw - tw // 2, th // 2, th - th // 2))
        return x, (0, 0)
    return x, lo


def checked_inputs(op, input, weight, bias):
    """(input with a batch dim, weight, bias, whether the input had none) for convolution `op`, after what every
    convolution checks first: one device, autocast's cast, floating point dtypes, the same dtype for all."""
    check_same_device(op, input, weight, bias)
    if _amp.active:
        input, weight, bias = _amp.cast_inputs("lower", input, weight, bias)
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and not t.dtype.is_floating_point:
            raise DTypeError(f"{op}: {name} must be floating point, got {t.dtype}")
    if input.dtype != weight.dtype or (bias is not None and bias.dtype != input.dtype):
        raise DTypeError(f"{op}: input ({input.dtype}), weight ({weight.dtype})"
                         + (f" and bias ({bias.dtype})" if bias is not None else "") + " must have the same dtype")
    unbatched = input.ndim == 3
    return (input.unsqueeze(0) if unbatched else input), weight, bias, unbatched


def pad_conv2d(input, weight, bias=None, pad=(0, 0, 0, 0), stride=1, dilation=1, groups=1):
    """conv2d(F.pad(input, pad), weight, bias, stride, 0, dilation, groups) with the zero padding folded into the
    convolution: `pad` in F.pad's order (left, right, top, bottom), each >= 0. Nothing padded is made - every path
    reads zeros outside the input - and the input gradient has the input's shape. The LDM VAE encoder's downsample
    is pad (0, 1, 0, 1) at stride 2."""
    if len(pad) != 4 or any(int(p) != p or p < 0 for p in pad):
        raise ValueError(f"pad_conv2d: pad must be four integers >= 0 (left, right, top, bottom), got {tuple(pad)}")
    input, weight, bias, unbatched = checked_inputs("pad_conv2d", input, weight, bias)
    pl, pr, pt, pb = (int(p) for p in pad)
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, (pt, pl), dilation, int(groups), pad_end=(pb, pr))
    if bias is not None and tuple(bias.shape) != (g.O,):
        raise ShapeError(f"pad_conv2d: bias of shape {fmt_shape(bias.shape)} for {g.O} output channels")
    y = Conv2d.apply(input, weight, bias, None, None, g)
    return y.squeeze(0) if unbatched else y


def _padding(op, input, weight, stride, padding, dilation):
    """(input, numeric padding) for conv2d's padding: an int, a pair, 'valid' or 'same'."""
    if isinstance(padding, str):
        if padding == "valid":
            return input, 0
        if padding == "same":
            return _same_padding(input, weight, stride, dilation)
        raise ValueError(f"{op}: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    return input, padding


def conv2d_add(input, weight, bias=None, add=None, residual=None, stride=1, padding=0, dilation=1, groups=1):
    """conv2d(input, weight, bias, stride, padding, dilation, groups) + add[:, :, None, None] + residual, the two
    adds made by the convolution's epilogue where the wgmma kernel runs (one pass over the output instead of three)
    and on the fresh output elsewhere. add: (N, O), a per-image bias (the UNet ResBlock's time embedding);
    residual: the output's shape (a skip connection); either may be None. Gradients: add's is the output gradient
    summed over the pixels, residual's the output gradient itself. An add or residual of another dtype than the
    convolution's (autocast) is added after it with the usual type promotion."""
    input, weight, bias, unbatched = checked_inputs("conv2d_add", input, weight, bias)
    if unbatched:
        raise ShapeError(f"conv2d_add: input must be (N, C, H, W), got {fmt_shape(input.shape[1:])}")
    input, padding = _padding("conv2d_add", input, weight, stride, padding, dilation)
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, padding, dilation, int(groups))
    if bias is not None and tuple(bias.shape) != (g.O,):
        raise ShapeError(f"conv2d_add: bias of shape {fmt_shape(bias.shape)} for {g.O} output channels")
    check_same_device("conv2d_add", input, add, residual)
    if add is not None and tuple(add.shape) != (g.N, g.O):
        raise ShapeError(f"conv2d_add: add of shape {fmt_shape(add.shape)}; it must be (N, O) = ({g.N}, {g.O})")
    if residual is not None and tuple(residual.shape) != (g.N, g.O, g.OH, g.OW):
        raise ShapeError(f"conv2d_add: residual of shape {fmt_shape(residual.shape)} for an output of shape "
                         f"{fmt_shape((g.N, g.O, g.OH, g.OW))}")
    e = add if add is None or add.dtype == input.dtype else None
    r = residual if residual is None or residual.dtype == input.dtype else None
    y = Conv2d.apply(input, weight, bias, e, r, g)
    if add is not None and e is None:
        y = y + add[:, :, None, None]
    if residual is not None and r is None:
        y = y + residual
    return y


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D convolution (cross-correlation), PyTorch's F.conv2d: input (N, C, H, W) or (C, H, W),
    weight (O, C/groups, KH, KW); padding an int, a pair, 'valid' or 'same'."""
    input, weight, bias, unbatched = checked_inputs("conv2d", input, weight, bias)
    input, padding = _padding("conv2d", input, weight, stride, padding, dilation)
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, padding, dilation, int(groups))
    if bias is not None and tuple(bias.shape) != (g.O,):
        raise ShapeError(f"conv2d: bias of shape {fmt_shape(bias.shape)} for {g.O} output channels")
    y = Conv2d.apply(input, weight, bias, None, None, g)
    return y.squeeze(0) if unbatched else y


def conv2d_memory_format(input, weight, stride=1, padding=0, dilation=1, groups=1):
    """The memory format in which conv2d(input, weight, ...) reads `input` without copying it: flame.channels_last
    where the forward - and, when weight requires grad under grad mode, the weight gradient - runs the
    implicit-GEMM kernels on a channel count that is a multiple of 8 (their operand is NHWC; a channels-last input
    is one already), else flame.contiguous_format. Whoever makes the input can write it so in the same pass
    (F.group_norm_silu(..., memory_format=...)): no transpose then sits between the two."""
    from ... import autograd
    if input.ndim != 4 or not isinstance(padding, (int, tuple, list)):
        return MF.contiguous_format
    g = geometry(tuple(input.shape), tuple(weight.shape), stride, padding, dilation, int(groups))
    x = input._data
    train_w = weight.requires_grad and autograd.is_grad_enabled()
    if g.C % 8 or input.dtype != weight.dtype or not use_igemm(x, g) or (train_w and not use_igemm(x, g, "dw")):
        return MF.contiguous_format
    return MF.channels_last
