"""A convolution's checked geometry and how its work is cut: the chunks of the im2col path (a workspace budget of
whole images or row bands) and the image ranges of the implicit GEMM."""
import math
import os
from collections import namedtuple

import numpy as np

from ... import dtypes as D
from ...errors import ShapeError, fmt_shape

Geom = namedtuple("Geom", "N C H W O KH KW sh sw ph pw dh dw OH OW G")
HALF = (np.dtype(np.float16), D.bfloat16.np)
_TARGET_COLS = 8192  # whole images are batched into one GEMM until it has this many columns


def pair(v, name):
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError(f"conv2d: {name} must be an int or a pair, got {v}")
    return v


def geometry(x_shape, w_shape, stride, padding, dilation, groups, pad_end=None):
    """Checked conv2d geometry. padding (numeric) is the top / left padding and, unless pad_end (bottom, right)
    says otherwise, the bottom / right one too. ph / pw are the leading padding; the output size (OH, OW) carries the
    trailing one (every path reads zeros past the input's last row and column)."""
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ShapeError(f"conv2d expects input (N, C, H, W) and weight (O, C/groups, KH, KW), got "
                         f"{fmt_shape(x_shape)} and {fmt_shape(w_shape)}")
    N, C, H, W = x_shape
    O, Cg, KH, KW = w_shape
    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding")
    dh, dw = pair(dilation, "dilation")
    if groups < 1 or C % groups or O % groups:
        raise ShapeError(f"conv2d: groups={groups} must divide input channels {C} and output channels {O}")
    if Cg * groups != C:
        raise ShapeError(f"conv2d: weight {fmt_shape(w_shape)} expects {Cg * groups} input channels "
                         f"(C/groups={Cg}, groups={groups}) but the input {fmt_shape(x_shape)} has {C}")
    pb, pr = (ph, pw) if pad_end is None else (int(pad_end[0]), int(pad_end[1]))
    if min(sh, sw, dh, dw) < 1 or min(ph, pw, pb, pr) < 0:
        raise ValueError(f"conv2d: stride {sh, sw} and dilation {dh, dw} must be >= 1, padding {ph, pw} "
                         f"(and at the end {pb, pr}) >= 0")
    OH = (H + ph + pb - dh * (KH - 1) - 1) // sh + 1
    OW = (W + pw + pr - dw * (KW - 1) - 1) // sw + 1
    if OH < 1 or OW < 1:
        raise ShapeError(f"conv2d: input {fmt_shape(x_shape)} (padded by {ph, pw}) is smaller than the dilated "
                         f"kernel {(dh * (KH - 1) + 1, dw * (KW - 1) + 1)}")
    return Geom(N, C, H, W, O, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW, groups)


def workspace_bytes(is_cuda):
    mb = os.environ.get("FLAME_CONV_WORKSPACE_MB")
    return int(float(mb) * 2 ** 20) if mb else (512 if is_cuda else 128) * 2 ** 20


def plan(g, itemsize, budget):
    """Chunks (n0, nimg, oh0, nrows) covering the output: whole images when one fits the budget, else row bands."""
    CK = g.C * g.KH * g.KW
    per_row = CK * g.OW * itemsize
    per_img = per_row * g.OH
    if per_img <= budget:
        k = max(1, min(g.N, budget // per_img, math.ceil(_TARGET_COLS / (g.OH * g.OW))))
        return [(n0, min(k, g.N - n0), 0, g.OH) for n0 in range(0, g.N, k)]
    rows = max(1, budget // per_row)
    return [(n, 1, r0, min(rows, g.OH - r0)) for n in range(g.N) for r0 in range(0, g.OH, rows)]


def is_pointwise(g):
    return g.KH == g.KW == 1 and g.sh == g.sw == 1 and g.ph == g.pw == 0 and (g.OH, g.OW) == (g.H, g.W)


def end_padding(g):
    """(bottom, right) padding the output reaches past the input: rows / columns of zeros the references add."""
    return (max(0, (g.OH - 1) * g.sh + g.dh * (g.KH - 1) + 1 - g.H - g.ph),
            max(0, (g.OW - 1) * g.sw + g.dw * (g.KW - 1) + 1 - g.W - g.pw))


def image_chunks(N, per_image, budget, per_pixel_rows):
    """(n0, k) image ranges whose NHWC copies (per_image bytes each) fit the budget; at least one image each."""
    k = max(1, min(N, 65535, budget // max(1, per_image), (2 ** 31 - 4096) // max(1, per_pixel_rows)))
    return [(n0, min(k, N - n0)) for n0 in range(0, N, k)]
