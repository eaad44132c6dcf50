"""The input gradient of a strided convolution as one stride-1 conv of dy per phase of dx (flame_core.ops.conv:
dx_phases, pack_phase_weight, phase_dx): on the cpu with a float64 NumPy stand-in for the kernels' conv_nhwc
against the im2col path's dx; on cuda through conv2d_backward (wgmma - all phases in one launch, strides up to 2 -
and mma.sync kernels) against float64."""
from unittest import mock

import numpy as np
import pytest

from flame_core import backend
from flame_core.dtypes import dtype as parse_dtype
from flame_core.kernels import conv as K
from flame_core.ops import conv as C

# (N, C, H, W, O, (KH, KW), (sh, sw), (ph, pw)): stride 2 with padding 1 and 0 (the VAE pads with F.pad, then
# convolves unpadded), odd sizes, stride 3 with a 5x5, a 1x1 at stride 2 (phases without taps: zeros), a 4x4, a
# stride larger than the kernel, per-axis strides / kernels / paddings
GEOMS = [
    (2, 5, 9, 8, 7, (3, 3), (2, 2), (1, 1)),
    (1, 6, 10, 10, 4, (3, 3), (2, 2), (0, 0)),
    (1, 3, 11, 13, 5, (3, 3), (2, 2), (0, 0)),
    (2, 4, 13, 12, 3, (5, 5), (3, 3), (2, 2)),
    (1, 4, 9, 9, 6, (1, 1), (2, 2), (0, 0)),
    (1, 3, 12, 11, 5, (4, 4), (2, 2), (1, 1)),
    (1, 3, 10, 11, 4, (2, 2), (3, 3), (0, 0)),
    (3, 4, 9, 14, 5, (3, 2), (2, 3), (1, 0)),
]


def _nhwc(x, Rp):
    """(B, R, H, W) -> (B, H*W, Rp), channels R..Rp-1 zero: K.to_nhwc's result."""
    B, R = x.shape[:2]
    out = np.zeros((B, x.shape[2] * x.shape[3], Rp), dtype=x.dtype)
    out[:, :, :R] = x.reshape(B, R, -1).transpose(0, 2, 1)
    return out


def _conv_nhwc(xt, wp, out, cg):
    """out (N, O, OH, OW) = the kernels' conv_nhwc: xt (N, H*W, Cp), wp (O, KH*KW*Cp), any-sign padding, zero
    outside the input."""
    x = xt.reshape(cg.N, cg.H, cg.W, cg.Cp)
    w = wp.reshape(cg.O, cg.KH, cg.KW, cg.Cp)
    out[...] = 0
    oh, ow = np.arange(cg.OH), np.arange(cg.OW)
    for kh in range(cg.KH):
        ih = oh * cg.sh - cg.ph + kh * cg.dh
        for kw in range(cg.KW):
            iw = ow * cg.sw - cg.pw + kw * cg.dw
            vh, vw = (ih >= 0) & (ih < cg.H), (iw >= 0) & (iw < cg.W)
            tap = np.zeros((cg.N, cg.OH, cg.OW, cg.Cp))
            tap[:, vh[:, None] & vw[None, :]] = x[:, ih[vh]][:, :, iw[vw]].reshape(cg.N, -1, cg.Cp)
            out += np.einsum("nhwc,oc->nohw", tap, w[:, kh, kw])


def _case(cfg, seed=0):
    N, Cc, H, W, O, (KH, KW), (sh, sw), (ph, pw) = cfg
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, Cc, H, W))
    w = rng.standard_normal((O, Cc, KH, KW))
    g = C.geometry(x.shape, w.shape, (sh, sw), (ph, pw), 1, 1)
    gy = rng.standard_normal((N, O, g.OH, g.OW))
    return x, w, g, gy


@pytest.mark.parametrize("cfg", GEOMS)
def test_phases_reproduce_the_strided_dx(cfg):
    x, w, g, gy = _case(cfg)
    want, _ = C.im2col_backward(gy, x, w, g, True, False)
    assert C.strided_dx(g)
    phases = C.dx_phases(g)
    # every tap is used exactly once over the phases, and the phases' rows / columns tile dx
    assert sorted((kh, kw) for p in phases for kh in p.kh for kw in p.kw) == \
        sorted((kh, kw) for kh in range(g.KH) for kw in range(g.KW))
    for p in phases:
        assert p.OH == len(range(p.a, g.H, g.sh)) and p.OW == len(range(p.b, g.W, g.sw))
    Op = K.round8(g.O)
    dx = np.full(x.shape, np.nan)  # phase_dx writes every element (zeros where a phase has no tap)
    C.phase_dx(_nhwc(gy, Op), w, g, dx, Op, _conv_nhwc)
    np.testing.assert_allclose(dx, want, rtol=1e-10, atol=1e-10)


def test_one_by_one_stride_two_has_one_phase():
    g = C.geometry((1, 4, 9, 9), (6, 4, 1, 1), 2, 0, 1, 1)
    assert [(p.a, p.b, p.kh, p.kw, p.ph, p.pw) for p in C.dx_phases(g)] == [(0, 0, (0,), (0,), 0, 0)]


def test_dilated_strided_conv_keeps_im2col():
    assert not C.strided_dx(C.geometry((1, 4, 12, 12), (6, 4, 3, 3), 2, 2, 2, 1))
    assert not C.strided_dx(C.geometry((1, 4, 12, 12), (6, 4, 3, 3), 1, 1, 1, 1))



def _strided_dx_check(x, w, g, gy, dtype, algo, monkeypatch):
    """dx of conv2d_backward on the kernels (FLAME_CONV_ALGO dx=algo) against float64 im2col: on wgmma with strides
    up to 2 every phase in one launch (conv_dx_phased_wgmma), else one conv per phase (phase_dx)."""
    cp = backend.cupy
    npdt = parse_dtype(dtype).np
    x, w, gy = (a.astype(npdt).astype(np.float64) for a in (x, w, gy))
    want, _ = C.im2col_backward(gy, x, w, g, True, False)
    phase_spy = mock.Mock(wraps=C.phase_dx)
    fused_spy = mock.Mock(wraps=K.conv_dx_phased_wgmma)
    monkeypatch.setattr(C.implicit_gemm, "phase_dx", phase_spy)  # igemm_backward calls it
    monkeypatch.setattr(K, "conv_dx_phased_wgmma", fused_spy)
    monkeypatch.setenv("FLAME_CONV_ALGO", f"dx={algo}")
    xd, wd, gd = (cp.asarray(a.astype(npdt)) for a in (x, w, gy))
    assert C.use_igemm(xd, g, "dx") and C.use_wgmma(xd, g, "dx") == (algo == "wgmma")
    dx, dw = C.conv2d_backward(gd, xd, wd, g, need_x=True, need_w=False)
    fused = algo == "wgmma" and g.sh <= 2 and g.sw <= 2
    assert dw is None and (fused_spy.call_count >= 1) == fused and (phase_spy.call_count >= 1) == (not fused)
    got = cp.asnumpy(dx).astype(np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= (1e-2 if dtype == "bfloat16" else 2e-3), err


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["wgmma", "igemm"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", GEOMS + [(2, 40, 17, 15, 72, (3, 3), (2, 2), (1, 1))])
def test_strided_dx_on_the_kernels(cfg, dtype, algo, monkeypatch):
    if algo == "wgmma" and not K.wgmma_available():
        pytest.skip("conv_wgmma.cu needs a compute capability 9.0 GPU")
    _strided_dx_check(*_case(cfg, 1), dtype, algo, monkeypatch)


# the one-launch phased dx over several channel tiles (C = 200: two, the second ragged) and many pixel tiles, in
# groups of 1, 2 and 3 pixel tiles (the last group short) and one group (0), with both tiles; and the VAE's
# downsample geometry (pad (0, 1, 0, 1) folded into the conv: a trailing pad)
@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["128x128", "128x256"])
@pytest.mark.parametrize("group", ["1", "2", "3", "0"])
@pytest.mark.parametrize("cfg", [(3, 200, 33, 31, 24, (3, 3), (2, 2), (1, 1)),
                                 (1, 136, 29, 36, 40, (3, 3), (2, 2), (0, 0), (1, 1)),
                                 (2, 24, 20, 21, 16, (3, 3), (1, 2), (1, 1)),
                                 # dy channels a multiple of 64: the TMA producer (per-phase im2col maps)
                                 (3, 200, 33, 31, 64, (3, 3), (2, 2), (1, 1)),
                                 (1, 136, 29, 36, 128, (3, 3), (2, 2), (0, 0), (1, 1)),
                                 (2, 72, 20, 21, 64, (3, 3), (1, 2), (1, 1)),
                                 (2, 40, 21, 19, 192, (5, 5), (2, 2), (2, 2))])
def test_phased_dx_tiles_and_groups(cfg, group, tile, monkeypatch):
    if not K.wgmma_available():
        pytest.skip("conv_wgmma.cu needs a compute capability 9.0 GPU")
    monkeypatch.setenv("FLAME_CONV_DX_GROUP", group)
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", tile)
    N, Cc, H, W, O, (KH, KW), stride, pad = cfg[:8]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, Cc, H, W))
    w = rng.standard_normal((O, Cc, KH, KW))
    g = C.geometry(x.shape, w.shape, stride, pad, 1, 1, pad_end=cfg[8] if len(cfg) > 8 else None)
    gy = rng.standard_normal((N, O, g.OH, g.OW))
    tiled = mock.Mock(wraps=K.TMA.tiled_2d)
    monkeypatch.setattr(K.TMA, "tiled_2d", tiled)
    _strided_dx_check(x, w, g, gy, "bfloat16", "wgmma", monkeypatch)
    assert (tiled.call_count > 0) == (O % 64 == 0 and K.tma_enabled())  # the TMA producer where it applies


def test_phased_dx_rejects_what_it_cannot_run(monkeypatch):
    """conv_dx_phased_wgmma's checks run before any launch (the cpu reaches them only without a device: the first
    check is the device's, so here the argument checks are asserted on a GPU only)."""
    ph = C.dx_phases(C.geometry((1, 8, 8, 8), (8, 8, 3, 3), 2, 1, 1, 1))
    if not K.wgmma_available():
        with pytest.raises(RuntimeError, match="sm_90a"):
            K.conv_dx_phased_wgmma(None, None, None, None, ph)
        return
    cp = backend.cupy
    cg = K.ConvGeom(1, 4, 4, 8, 8, 8, 8, 3, 3, 2, 2, 1, 1, 1, 1)
    gt, wd = cp.zeros((1, 16, 8), cp.float16), cp.zeros((8, 72), cp.float16)
    dx = cp.zeros((1, 8, 8, 8), cp.float16)
    with pytest.raises(ValueError, match="not split over K"):
        K.conv_dx_phased_wgmma(gt, wd, dx, cg, ph, plan="128x256:s2")
    with pytest.raises(ValueError, match="strides"):
        K.conv_dx_phased_wgmma(gt, wd, dx, cg._replace(sh=3), ph)
    with pytest.raises(ValueError, match="do not match"):
        K.conv_dx_phased_wgmma(gt, wd[:, :64], dx, cg, ph)
