"""The implicit GEMM on tensor cores (cuda, float16/bfloat16; flame_core/kernels/conv.py, cuda_src/conv_igemm.cu and
conv_wgmma.cu), for groups=1 and every kernel size other than a plain 1x1: x is copied to NHWC with channels padded
to a multiple of 8 and the weights to (O, KH*KW*Cp); the kernel gathers the column matrix tile by tile into shared
memory, so nothing 9x the input exists. Batches are cut into image chunks whose NHWC copies fit the workspace budget.
A channels-last x (memory N, H, W, C with C a multiple of 8) is that copy already, and so is a channels-last dY: the
kernels read them in place. Per chunk:
    forward     y = conv(x_nhwc, Wp) (+ bias), written NCHW by the kernel's epilogue
    backward    dX = conv(dY_nhwc, W flipped and transposed) at stride 1; strided (dilation 1): one stride-1 conv of
                dY_nhwc per phase of dX (phases.py) - on the wgmma kernel (strides up to 2) every phase in one
                launch that writes dX itself (one_launch_dx)
                dW = dY^T @ X_cols, reduced over pixels in slices of fp32 partials (deterministic, no atomics)"""
import numpy as np

from ... import memory_formats as MF
from .phases import dx_phases, one_launch_dx, phase_dx, strided_dx
from .planning import image_chunks, workspace_bytes
from .routing import tuned_plan, use_wgmma


def nhwc(a, Rp):
    """The kernels' (N, H*W, Rp) channel-last operand of `a` (N, C, H, W): a view when `a` is channels-last (memory
    N, H, W, C) with C = Rp, else K.to_nhwc's copy (channels C..Rp-1 zero)."""
    from ...kernels import conv as K
    if a.ndim == 4 and a.shape[1] == Rp and MF.is_channels_last(a):
        N, C, H, W = a.shape
        return a.transpose(0, 2, 3, 1).reshape(N, H * W, C)
    return K.to_nhwc(a, Rp)


def reads_in_place(a, channels):
    """Whether the implicit-GEMM kernels read array `a` (channels-last, `channels` a multiple of 8) without a copy."""
    from ...kernels import conv as K
    return K.round8(channels) == channels and MF.is_channels_last(a)


def igemm_forward(x, w, g, bias, emb=None, res=None, wgmma=False):
    """The implicit-GEMM forward, image chunk by chunk, on the wgmma kernel (`wgmma`: use_wgmma's answer) or the
    mma.sync one; emb / res (the wgmma kernel's epilogue adds) chunked too."""
    from ...kernels import conv as K
    Cp = K.round8(g.C)
    wp = K.pack_weight(w, Cp)  # (O, KH*KW*Cp)
    y = K.empty((g.N, g.O, g.OH, g.OW), x.dtype)
    budget = workspace_bytes(True)
    plan = tuned_plan(g, "fwd") if wgmma else None
    for n0, k in image_chunks(g.N, g.H * g.W * Cp * x.itemsize, budget, max(g.H * g.W, g.OH * g.OW)):
        xt = nhwc(x[n0:n0 + k], Cp)  # (k, H*W, Cp): a view of a channels-last x
        cg = K.ConvGeom(k, g.H, g.W, Cp, g.O, g.OH, g.OW, g.KH, g.KW, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
        if wgmma:
            K.conv_nhwc_wgmma(xt, wp, y[n0:n0 + k], cg, bias, plan=plan, emb=None if emb is None else emb[n0:n0 + k],
                              res=None if res is None else res[n0:n0 + k])
        else:
            K.conv_nhwc(xt, wp, y[n0:n0 + k], cg, bias, budget)
        del xt
    return y


def igemm_backward(gy, x, w, g, need_x, need_w):
    """dx and dw by the implicit-GEMM kernels. dx at stride 1 is one conv of dy (the transposed conv is then a
    conv); a strided dx (dilation 1) is one stride-1 conv per phase of dx: on the wgmma kernel (strides up to 2) all
    phases in one launch writing dx directly (conv_dx_phased_wgmma), else one launch each (phase_dx)."""
    from ...kernels import conv as K
    Cp, Op = K.round8(g.C), K.round8(g.O)
    budget = workspace_bytes(True)
    per_image = ((g.H * g.W * Cp if need_w else 0) + g.OH * g.OW * Op) * x.itemsize
    wgmma_w = need_w and use_wgmma(x, g, "dw")
    # the wgmma dw kernel's offsets in a chunk's x and dY copies are 32-bit: chunks of at most 2 GiB keep them so
    chunks = image_chunks(g.N, per_image, min(budget, 2 << 30) if wgmma_w else budget, max(g.H * g.W, g.OH * g.OW))
    phased = need_x and strided_dx(g)
    wgmma_x = need_x and use_wgmma(x, g, "dx")
    fused = wgmma_x and one_launch_dx(g)  # every phase in one launch (conv_dx_phased_wgmma)
    dx = K.empty(x.shape, x.dtype) if need_x else None
    wd = K.pack_weight_dx(w, Op) if need_x and (fused or not phased) else None  # (C, KH*KW*Op)
    if fused:
        phases = dx_phases(g)
        if len(phases) < g.sh * g.sw:  # a phase with no tap: its part of dx is zero
            dx[...] = 0
    dw = K.empty(w.shape, w.dtype) if need_w else None
    acc32 = K.empty(w.shape, np.float32) if need_w and len(chunks) > 1 else None  # dw summed over chunks
    # dx: the wgmma kernel with the measured plan, else the mma.sync kernel
    conv_x = (lambda a, b, c, d: K.conv_nhwc_wgmma(a, b, c, d, None, budget, plan=tuned_plan(g, "dx"))) \
        if wgmma_x else (lambda a, b, c, d: K.conv_nhwc(a, b, c, d, None, budget))
    for i, (n0, k) in enumerate(chunks):
        gt = nhwc(gy[n0:n0 + k], Op)  # (k, OH*OW, Op)
        if fused:
            cg = K.ConvGeom(k, g.OH, g.OW, Op, g.C, g.H, g.W, g.KH, g.KW, g.sh, g.sw, g.ph, g.pw, 1, 1)
            K.conv_dx_phased_wgmma(gt, wd, dx[n0:n0 + k], cg, phases, plan=tuned_plan(g, "dx"))
        elif phased:
            phase_dx(gt, w, g, dx[n0:n0 + k], Op, conv_x)
        elif need_x:  # dx = conv(dy, w flipped), stride 1, padding d*(K-1) - p
            cg = K.ConvGeom(k, g.OH, g.OW, Op, g.C, g.H, g.W, g.KH, g.KW, 1, 1,
                            g.dh * (g.KH - 1) - g.ph, g.dw * (g.KW - 1) - g.pw, g.dh, g.dw)
            conv_x(gt, wd, dx[n0:n0 + k], cg)
        if need_w:
            xt = nhwc(x[n0:n0 + k], Cp)  # (k, H*W, Cp)
            cg = K.ConvGeom(k, g.H, g.W, Cp, g.O, g.OH, g.OW, g.KH, g.KW, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
            if wgmma_w:
                K.conv_dw_nhwc_wgmma(gt, xt, cg, g.C, dw=dw if i == len(chunks) - 1 else None, acc32=acc32,
                                     accumulate=i > 0, budget=budget, plan=tuned_plan(g, "dw"))
            else:
                K.conv_dw_nhwc(gt, xt, cg, g.C, dw=dw if i == len(chunks) - 1 else None, acc32=acc32,
                               accumulate=i > 0, budget=budget)
            del xt
        del gt
    return dx, dw
