"""unfold (im2col) and fold (col2im) with PyTorch's F.unfold / F.fold layout: (N, C, H, W) <-> (N, C * kh * kw, L),
the rows ordered channel, then kernel row, then kernel column, the L = OH * OW block positions row-major.

Each kernel offset is one strided slice of the zero-padded image (no index arrays): unfold copies the slices into the
rows, fold adds the rows back into a zero image (overlapping blocks sum) and crops the padding. Each is the other's
adjoint, so each one's backward is the other (and double backward follows)."""
from .. import backend
from ..autograd.function import Function
from ..errors import ShapeError, fmt_shape
from ..tensor import _wrap
from .pooling import _pair, _window  # (the same strided window slice of the padded image as the pools')


def _geometry(op, H, W, kernel_size, dilation, padding, stride):
    (kh, kw), (dh, dw) = _pair(kernel_size, f"{op}: kernel_size"), _pair(dilation, f"{op}: dilation")
    (ph, pw), (sh, sw) = _pair(padding, f"{op}: padding"), _pair(stride, f"{op}: stride")
    if min(kh, kw, dh, dw, sh, sw) < 1 or min(ph, pw) < 0:
        raise ValueError(f"{op}: kernel_size, dilation and stride must be positive and padding non-negative, got "
                         f"{(kh, kw)}, {(dh, dw)}, {(sh, sw)}, {(ph, pw)}")
    oh = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ShapeError(f"{op}: a {kh}x{kw} kernel (dilation {(dh, dw)}, padding {(ph, pw)}) does not fit a "
                         f"{H}x{W} image")
    return dict(kh=kh, kw=kw, dh=dh, dw=dw, ph=ph, pw=pw, sh=sh, sw=sw, OH=oh, OW=ow, H=H, W=W)


def _unfold_arr(a, g):
    xp = backend.xp_of(a)
    N, C = a.shape[:2]
    p = xp.pad(a, ((0, 0), (0, 0), (g["ph"], g["ph"]), (g["pw"], g["pw"]))) if g["ph"] or g["pw"] else a
    out = xp.empty((N, C, g["kh"], g["kw"], g["OH"], g["OW"]), dtype=a.dtype)
    for i in range(g["kh"]):
        for j in range(g["kw"]):
            out[:, :, i, j] = _window(p, g, i, j)
    return out.reshape(N, C * g["kh"] * g["kw"], g["OH"] * g["OW"])


def _fold_arr(b, g):
    xp = backend.xp_of(b)
    N = b.shape[0]
    C = b.shape[1] // (g["kh"] * g["kw"])
    blocks = b.reshape(N, C, g["kh"], g["kw"], g["OH"], g["OW"])
    p = xp.zeros((N, C, g["H"] + 2 * g["ph"], g["W"] + 2 * g["pw"]), dtype=b.dtype)
    for i in range(g["kh"]):
        for j in range(g["kw"]):
            _window(p, g, i, j)[...] += blocks[:, :, i, j]
    return p[:, :, g["ph"]:g["ph"] + g["H"], g["pw"]:g["pw"] + g["W"]]


class Unfold(Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _wrap(_unfold_arr(x._data, g))

    @staticmethod
    def backward(ctx, gy):
        return Fold.apply(gy, ctx.g), None


class Fold(Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _wrap(_fold_arr(x._data, g))

    @staticmethod
    def backward(ctx, gy):
        return Unfold.apply(gy, ctx.g), None


def unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """PyTorch's F.unfold: (N, C, H, W) or (C, H, W) -> (N, C * kh * kw, L) or (C * kh * kw, L)."""
    if input.ndim not in (3, 4):
        raise ShapeError(f"unfold: expected (N, C, H, W) or (C, H, W), got {fmt_shape(input.shape)}")
    x = input if input.ndim == 4 else input.unsqueeze(0)
    g = _geometry("unfold", x.shape[2], x.shape[3], kernel_size, dilation, padding, stride)
    y = Unfold.apply(x, g)
    return y if input.ndim == 4 else y.squeeze(0)


def fold(input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    """PyTorch's F.fold: (N, C * kh * kw, L) or (C * kh * kw, L) -> (N, C, H, W) or (C, H, W), (H, W) = output_size;
    overlapping blocks are summed."""
    if input.ndim not in (2, 3):
        raise ShapeError(f"fold: expected (N, C * kh * kw, L) or (C * kh * kw, L), got {fmt_shape(input.shape)}")
    H, W = _pair(output_size, "fold: output_size")
    x = input if input.ndim == 3 else input.unsqueeze(0)
    g = _geometry("fold", H, W, kernel_size, dilation, padding, stride)
    k = g["kh"] * g["kw"]
    if x.shape[1] % k:
        raise ShapeError(f"fold: dimension 1 of the input ({x.shape[1]}) must be divisible by the kernel's "
                         f"{g['kh']} x {g['kw']} = {k} positions")
    if x.shape[2] != g["OH"] * g["OW"]:
        raise ShapeError(f"fold: the input has {x.shape[2]} blocks, the output size {(H, W)} with this kernel, "
                         f"dilation, padding and stride holds {g['OH']} x {g['OW']} = {g['OH'] * g['OW']}")
    y = Fold.apply(x, g)
    return y if input.ndim == 3 else y.squeeze(0)
