"""The input gradient of a strided convolution (dilation 1) as stride-1 convolutions of dY, one per phase of dX
(rows a::sh, columns b::sw), with no col2im."""
from collections import namedtuple

from ... import backend

DxPhase = namedtuple("DxPhase", "a b kh kw ph pw OH OW")


def strided_dx(g):
    """Whether the input gradient of a strided conv goes through dx_phases (dilation 1, groups 1)."""
    return (g.sh > 1 or g.sw > 1) and g.dh == g.dw == 1 and g.G == 1


def one_launch_dx(g):
    """Whether a strided conv's dx on the wgmma kernel runs every phase in one launch (conv_dx_phased_wgmma: strides
    up to 2) rather than one launch per phase (phase_dx)."""
    return strided_dx(g) and g.sh <= 2 and g.sw <= 2


def dx_phases(g):
    """The input gradient of a strided conv (dilation 1) as stride-1 convs of dy, one per phase (a, b) of dx: rows
    a::sh and columns b::sw of dx come from the taps kh = a + ph (mod sh) and kw = b + pw (mod sw), taken largest
    first. A stride-1 conv reads its input at i - p + j for tap j; phase row i reads dy row i + (a + ph - kh_j) / sh,
    so its taps are those kh in that order and its padding p = -(a + ph - kh_0) / sh (any sign: the kernels zero-fill
    outside dy). Phases with no tap or no rows are left out: their part of dx is zero."""
    def axis(stride, pad, taps, size):
        out = []
        for a in range(stride):
            T = [k for k in range(taps - 1, -1, -1) if (a + pad - k) % stride == 0]
            rows = -(-(size - a) // stride)
            if T and rows > 0:
                out.append((a, tuple(T), -((a + pad - T[0]) // stride), rows))
        return out
    return [DxPhase(a, b, ta, tb, pa, pb, ra, rb)
            for a, ta, pa, ra in axis(g.sh, g.ph, g.KH, g.H) for b, tb, pb, rb in axis(g.sw, g.pw, g.KW, g.W)]


def pack_phase_weight(w, ph, sh, sw, Op):
    """The packed (C, len(kh)*len(kw)*Op) weights of one dx phase of a conv of stride (sh, sw): out[c, (i*len(kw) +
    j)*Op + o] = w[o, c, ph.kh[i], ph.kw[j]] (o < O, else 0). The taps are strided slices (views, no index arrays:
    no host-to-device copy, so a CUDA graph can capture it)."""
    xp = backend.xp_of(w)
    O, C = w.shape[:2]
    sub = w[:, :, ph.kh[0]::-sh, ph.kw[0]::-sw].transpose(1, 2, 3, 0)  # (C, ka, kb, O): taps largest first
    out = xp.zeros((C, len(ph.kh), len(ph.kw), Op), dtype=w.dtype)
    out[..., :O] = sub
    return out.reshape(C, -1)


def phase_dx(gt, w, g, dx, Op, conv):
    """dx (k images) of a strided conv from gt = dy channel-last (k, OH*OW, Op): one stride-1 conv per phase of
    dx_phases, `conv(gt, wp, out, cg)` (the kernels' conv_nhwc signature) into a (k, C, rows, cols) temporary.
    On a GPU with strides up to 2 the temporaries are woven into dx by one pass (conv_dx_interleave, zeros where a
    phase has no tap); otherwise each is written to dx[:, :, a::sh, b::sw], after zeroing dx when a phase has no
    tap. Every element of dx is written either way."""
    from ...kernels import conv as K
    xp = backend.xp_of(gt)
    k = gt.shape[0]
    weave = backend.is_cuda_array(dx) and g.sh <= 2 and g.sw <= 2
    if not weave and len(dx_phases(g)) < g.sh * g.sw:
        dx[...] = 0
    outs = {}
    for ph in dx_phases(g):
        wp = pack_phase_weight(w, ph, g.sh, g.sw, Op)
        cg = K.ConvGeom(k, g.OH, g.OW, Op, g.C, ph.OH, ph.OW, len(ph.kh), len(ph.kw), 1, 1, ph.ph, ph.pw, 1, 1)
        out = xp.empty((k, g.C, ph.OH, ph.OW), dtype=dx.dtype)
        conv(gt, wp, out, cg)
        del wp
        if weave:
            outs[ph.a, ph.b] = out
        else:
            dx[:, :, ph.a::g.sh, ph.b::g.sw] = out
        del out
    if weave:
        K.dx_interleave(outs, dx, g.sh, g.sw)
