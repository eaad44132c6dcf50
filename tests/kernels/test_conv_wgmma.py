"""The Hopper implicit-GEMM conv (cuda_src/conv_wgmma.cu: conv_nhwc_wgmma, conv_dw_nhwc_wgmma) against a float64
NumPy reference, as the forward, the stride-1 input gradient and the weight gradient; its routing ('auto' on compute
capability 9.0, FLAME_CONV_ALGO=wgmma / fwd=wgmma / dx=wgmma / dw=wgmma, 'igemm' for the mma.sync kernels), and on
the cpu the parsing of that setting and the cpu path's indifference to it."""
from unittest import mock

import numpy as np
import pytest

import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.dtypes import dtype as parse_dtype
from flame_core.kernels import conv as K
from flame_core.kernels import launching
from flame_core.ops import conv as C

# (N, C, H, W, O, (KH, KW), (sh, sw), (top, bottom, left, right) padding, (dh, dw)): ragged channels (Cp > C, O not a
# multiple of 128), odd pixel counts (unpaired stores), several k-tiles and pixel tiles, strides, dilation, taps.
GEOMS = [
    (1, 13, 9, 7, 7, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),        # C=13 -> Cp=16, O=7, 63 pixels
    (3, 40, 11, 13, 64, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),     # batch 3, K = 9*40 (a K tail), P=429
    (2, 320, 9, 10, 330, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),    # 45 k-tiles (many ring laps), 3 channel tiles
    (3, 40, 15, 17, 64, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),     # stride 2
    (1, 64, 16, 16, 24, (3, 3), (2, 2), (0, 1, 0, 1), (1, 1)),     # the VAE downsample's (0, 1, 0, 1) padding
    (2, 13, 12, 11, 40, (3, 3), (2, 2), (0, 1, 0, 1), (1, 1)),     # the same, odd sizes
    (1, 40, 9, 9, 330, (1, 1), (1, 1), (1, 1, 1, 1), (1, 1)),      # 1x1 with padding (not a plain pointwise)
    (2, 40, 9, 9, 64, (1, 1), (2, 2), (0, 0, 0, 0), (1, 1)),       # 1x1 stride 2
    (1, 24, 13, 12, 20, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2)),     # dilation 2
    (1, 9, 7, 8, 10, (3, 2), (1, 1), (1, 1, 0, 0), (1, 2)),        # KH != KW, per-axis padding / dilation
    (2, 24, 10, 12, 16, (5, 5), (2, 2), (2, 2, 2, 2), (1, 1)),     # 5x5 stride 2
    (1, 16, 33, 35, 64, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),     # 1155 pixels: ragged last pixel tile
    (1, 8, 6, 6, 130, (3, 3), (1, 1), (3, 3, 3, 3), (1, 1)),       # padding past the kernel reach: empty taps
    (2, 16, 12, 11, 24, (6, 5), (1, 1), (2, 3, 2, 2), (1, 1)),     # 30 taps: the rows' tap masks near 32 bits
]


def _case(cfg, dtype, seed=0):
    """Inputs rounded to `dtype` (as float64), the kernel geometry (top/left padding; the kernel zero-fills past the
    bottom/right edge, so bottom/right padding is the output size alone) and the float64 reference output."""
    N, Cc, H, W, O, (KH, KW), (sh, sw), (pt, pb, pl, pr), (dh, dw) = cfg
    rng = np.random.default_rng(seed)
    npdt = parse_dtype(dtype).np
    x = rng.standard_normal((N, Cc, H, W)).astype(npdt).astype(np.float64)
    w = (rng.standard_normal((O, Cc, KH, KW)) * 0.2).astype(npdt).astype(np.float64)
    b = rng.standard_normal(O).astype(npdt).astype(np.float64)
    xpad = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    g = C.geometry(xpad.shape, w.shape, (sh, sw), 0, (dh, dw), 1)
    want = C.im2col_forward(xpad, w, g)  # the cpu path in float64: the reference
    return x, w, b, g, want


def _run_kernel(cfg, x, w, b, g, dtype):
    cp = backend.cupy
    N, Cc, H, W, O, (KH, KW), (sh, sw), (pt, pb, pl, pr), (dh, dw) = cfg
    npdt = parse_dtype(dtype).np
    Cp = K.round8(Cc)
    xd, wd = cp.asarray(x.astype(npdt)), cp.asarray(w.astype(npdt))
    bd = None if b is None else cp.asarray(b.astype(npdt))
    xt, wp = K.to_nhwc(xd, Cp), K.pack_weight(wd, Cp)
    out = cp.full((N, O, g.OH, g.OW), np.nan, dtype=npdt)  # an element the kernel does not write stays NaN
    cg = K.ConvGeom(N, H, W, Cp, O, g.OH, g.OW, KH, KW, sh, sw, pt, pl, dh, dw)
    before = launching.launches
    K.conv_nhwc_wgmma(xt, wp, out, cg, bd)
    assert launching.launches > before
    return cp.asnumpy(out).astype(np.float64)


def _assert_close(got, want, dtype, what):
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} outputs not written / not finite"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= (1e-2 if dtype == "bfloat16" else 2e-3), f"{what}: relative error {err:.3g}"


def _grad_case(xshape, wshape, stride, pad, dil, dtype, seed):
    """x, w (scaled 0.2), the geometry and an output gradient, all rounded to `dtype` and held in float64."""
    rng = np.random.default_rng(seed)
    npdt = parse_dtype(dtype).np
    x = rng.standard_normal(xshape).astype(npdt).astype(np.float64)
    w = (rng.standard_normal(wshape) * 0.2).astype(npdt).astype(np.float64)
    g = C.geometry(x.shape, w.shape, stride, pad, dil, 1)
    gy = rng.standard_normal((xshape[0], wshape[0], g.OH, g.OW)).astype(npdt).astype(np.float64)
    return x, w, g, gy


def _need_sm90():
    if not K.wgmma_available():
        pytest.skip("conv_wgmma.cu needs a compute capability 9.0 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("producers", ["1", "2"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tile", sorted(K.WGMMA_TILES) + ["128x128:s3", "128x256:s2"])   # and split over K
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", GEOMS)
def test_wgmma_conv_matches_reference(cfg, dtype, tile, bias, producers, monkeypatch):
    """The forward against float64 with each tile and split, one and two producer warpgroups."""
    _need_sm90()
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", tile)
    monkeypatch.setenv("FLAME_CONV_FWD_PRODUCERS", producers)
    monkeypatch.setenv("FLAME_CONV_TMA", "0")  # the cp.async gather (the TMA producer: its own test below)
    x, w, b, g, want = _case(cfg, dtype)
    if bias:
        want = want + b.reshape(1, -1, 1, 1)
    got = _run_kernel(cfg, x, w, b if bias else None, g, dtype)
    _assert_close(got, want, dtype, f"{cfg} {tile} bias={bias}")


# geometries the TMA producer takes (input channels a multiple of 64): ragged O, odd sizes and batch 3 (the im2col walk
# crosses rows and images inside a tile), strides, the VAE's (0, 1, 0, 1) padding, dilation, a 1x1 with padding, a
# 5x5 at stride 2, padding past the kernel's reach, and many pixel tiles
TMA_GEOMS = [
    (3, 64, 11, 13, 70, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    (2, 128, 17, 15, 130, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    (1, 64, 16, 16, 24, (3, 3), (2, 2), (0, 1, 0, 1), (1, 1)),
    (2, 64, 13, 11, 40, (3, 3), (2, 2), (0, 1, 0, 1), (1, 1)),
    (1, 192, 13, 12, 20, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2)),
    (1, 64, 9, 9, 200, (1, 1), (1, 1), (1, 1, 1, 1), (1, 1)),
    (2, 64, 10, 12, 16, (5, 5), (2, 2), (2, 2, 2, 2), (1, 1)),
    (1, 64, 6, 6, 130, (3, 3), (1, 1), (3, 3, 3, 3), (1, 1)),
    (1, 320, 37, 35, 320, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(K.WGMMA_TILES) + ["128x128:s3", "128x256:t2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", TMA_GEOMS)
def test_wgmma_tma_producer_matches_reference(cfg, dtype, tile, monkeypatch):
    """The TMA producer (a tiled weight map, an im2col map of x) against float64, with each tile, a split over K and
    a tail split (a GPU of 3 SMs as far as the planner knows); and equal to the cp.async gather's output."""
    _need_sm90()
    monkeypatch.setattr(K.P, "sm_count", lambda: 3)
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", tile)
    x, w, b, g, want = _case(cfg, dtype, seed=4)
    want = want + b.reshape(1, -1, 1, 1)
    spy = mock.Mock(wraps=K.TMA.im2col_nhwc)
    monkeypatch.setattr(K.TMA, "im2col_nhwc", spy)
    monkeypatch.setenv("FLAME_CONV_TMA", "1")
    got = _run_kernel(cfg, x, w, b, g, dtype)
    assert spy.call_count == 1  # one map per call (a tail split's two launches share it)
    _assert_close(got, want, dtype, f"{cfg} {tile} TMA")
    monkeypatch.setenv("FLAME_CONV_TMA", "0")
    gathered = _run_kernel(cfg, x, w, b, g, dtype)
    assert spy.call_count == 1  # the gather: no map
    np.testing.assert_allclose(got, gathered, rtol=0, atol=np.abs(want).max() * 2e-3)


def test_tma_setting_is_checked(monkeypatch):
    monkeypatch.setenv("FLAME_CONV_TMA", "yes")
    with pytest.raises(ValueError, match="FLAME_CONV_TMA"):
        K.tma_enabled()
    monkeypatch.setenv("FLAME_CONV_TMA", "0")
    assert K.tma_enabled() is False
    assert K._im2col_map(None, K.ConvGeom(1, 8, 8, 64, 64, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1), 128) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_matches_igemm(dtype, monkeypatch):
    """The same NHWC copy and packed weights through conv_nhwc (mma.sync) and conv_nhwc_wgmma: the two fp32
    accumulations differ only in summation order."""
    _need_sm90()
    cp = backend.cupy
    cfg = (2, 64, 20, 18, 96, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    x, w, b, g, want = _case(cfg, dtype, seed=5)
    npdt = parse_dtype(dtype).np
    got = _run_kernel(cfg, x, w, b, g, dtype)
    Cp = K.round8(64)
    ref = cp.empty((2, 96, g.OH, g.OW), dtype=npdt)
    K.conv_nhwc(K.to_nhwc(cp.asarray(x.astype(npdt)), Cp), K.pack_weight(cp.asarray(w.astype(npdt)), Cp), ref,
                K.ConvGeom(2, 20, 18, Cp, 96, g.OH, g.OW, 3, 3, 1, 1, 1, 1, 1, 1), cp.asarray(b.astype(npdt)))
    _assert_close(got, cp.asnumpy(ref).astype(np.float64), dtype, "wgmma vs igemm")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(K.WGMMA_TILES))
def test_wgmma_kernel_resources(tile):
    """No spills, and the dynamic shared memory fits the device's opt-in limit."""
    _need_sm90()
    info = K.wgmma_kernel_info(tile, parse_dtype("bfloat16").np)
    assert info["local_size_bytes"] == 0, info
    assert info["dynamic_smem"] <= K.max_smem(), info



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_routing_fwd(dtype, monkeypatch):
    """fwd=wgmma and 'auto' (where it takes the implicit GEMM) run the wgmma kernel; 'igemm' the mma.sync one."""
    _need_sm90()
    cp = backend.cupy
    cfg = (3, 40, 11, 13, 64, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    x, w, b, g, want = _case(cfg, dtype, seed=1)
    want = want + b.reshape(1, -1, 1, 1)
    npdt = parse_dtype(dtype).np
    xd, wd, bd = (cp.asarray(a.astype(npdt)) for a in (x, w, b))
    gs = C.geometry(x.shape, w.shape, 1, 1, 1, 1)
    wg_spy, ig_spy = mock.Mock(wraps=K.conv_nhwc_wgmma), mock.Mock(wraps=K.conv_nhwc)
    monkeypatch.setattr(K, "conv_nhwc_wgmma", wg_spy)
    monkeypatch.setattr(K, "conv_nhwc", ig_spy)
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma")
    assert C.use_wgmma(xd, gs)
    _assert_close(cp.asnumpy(C.conv2d_forward(xd, wd, gs, bd)).astype(np.float64), want, dtype, "fwd=wgmma")
    assert (wg_spy.call_count, ig_spy.call_count) == (1, 0)
    # image chunks: one launch per chunk, each writing its own images
    monkeypatch.setenv("FLAME_CONV_WORKSPACE_MB", "0.005")
    _assert_close(cp.asnumpy(C.conv2d_forward(xd, wd, gs, bd)).astype(np.float64), want, dtype, "chunked")
    chunks = C.image_chunks(3, 11 * 13 * 40 * 2, C.workspace_bytes(True), 11 * 13)
    assert len(chunks) == 3 and wg_spy.call_count == 1 + len(chunks)
    monkeypatch.delenv("FLAME_CONV_WORKSPACE_MB")
    # 'auto' with the implicit GEMM chosen (threshold 0): the wgmma kernel on this device
    monkeypatch.setenv("FLAME_CONV_ALGO", "auto")
    monkeypatch.setenv("FLAME_CONV_IM2COL_MAX_MB", "0")
    calls = wg_spy.call_count
    assert C.use_igemm(xd, gs) and C.use_wgmma(xd, gs)
    _assert_close(cp.asnumpy(C.conv2d_forward(xd, wd, gs, bd)).astype(np.float64), want, dtype, "auto")
    assert (wg_spy.call_count, ig_spy.call_count) == (calls + 1, 0)
    # 'igemm', or 'auto' with WGMMA_AUTO off: the mma.sync kernel
    monkeypatch.setenv("FLAME_CONV_ALGO", "igemm")
    assert C.use_igemm(xd, gs) and not C.use_wgmma(xd, gs)
    _assert_close(cp.asnumpy(C.conv2d_forward(xd, wd, gs, bd)).astype(np.float64), want, dtype, "igemm")
    monkeypatch.setenv("FLAME_CONV_ALGO", "auto")
    monkeypatch.setattr(C.routing, "WGMMA_AUTO", False)
    assert not C.use_wgmma(xd, gs)
    _assert_close(cp.asnumpy(C.conv2d_forward(xd, wd, gs, bd)).astype(np.float64), want, dtype, "auto, off")
    assert (wg_spy.call_count, ig_spy.call_count) == (calls + 1, 2)


# dx as a conv of dy: stride 1 geometries (N, C, H, W, O, k, padding, dilation): ragged channels, batch 3, odd sizes,
# a 1x1 with padding, dilation, padding past the kernel's reach (dx's own padding negative)
DX_GEOMS = [
    (1, 13, 9, 7, 7, 3, 1, 1),
    (3, 40, 11, 13, 64, 3, 1, 1),
    (2, 330, 9, 10, 200, 3, 1, 1),
    (1, 24, 13, 12, 20, 3, 2, 2),
    (1, 40, 9, 9, 130, 1, 1, 1),
    (2, 16, 12, 11, 24, 5, 2, 1),
    (1, 8, 8, 8, 16, 3, 3, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("producers", ["1", "2"])
@pytest.mark.parametrize("tile", ["128x128:t2", "128x256:t3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", GEOMS)
def test_wgmma_tail_split_matches_reference(cfg, dtype, tile, producers, monkeypatch):
    """A tail split (whole waves, then the last partial wave's pixel tiles split over K; its partials reduced from
    a pixel inside an image on): a GPU of 3 SMs as far as the planner knows, so the tiny geometries have tails."""
    _need_sm90()
    monkeypatch.setenv("FLAME_CONV_FWD_PRODUCERS", producers)
    monkeypatch.setenv("FLAME_CONV_TMA", "0")  # the cp.async gather
    monkeypatch.setattr(K.P, "sm_count", lambda: 3)
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", tile)
    x, w, b, g, want = _case(cfg, dtype)
    want = want + b.reshape(1, -1, 1, 1)
    name = tile.partition(":")[0]
    NP = cfg[0] * g.OH * g.OW
    dp = K.tail_plan(-(-cfg[4] // 128), -(-NP // K.WGMMA_TILES[name][0]), 3)
    firsts = []
    red = K._splitk_reduce
    monkeypatch.setattr(K, "_splitk_reduce", lambda *a, **k: firsts.append(a[4] if len(a) > 4 else 0) or red(*a, **k))
    got = _run_kernel(cfg, x, w, b, g, dtype)
    assert firsts == ([dp * K.WGMMA_TILES[name][0]] if dp else [])   # the tail's partials, reduced from its pixel
    _assert_close(got, want, dtype, f"{cfg} {tile}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_tail_split_at_full_size(dtype, monkeypatch):
    """The same on the device's own SM count: 3 images of 57x57 (an odd pixel count), 130 channels (two channel
    tiles, the second ragged): more than one wave of 128x128 tiles."""
    _need_sm90()
    cfg = (3, 24, 57, 57, 130, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", "128x128:t2")
    x, w, b, g, want = _case(cfg, dtype, seed=5)
    want = want + b.reshape(1, -1, 1, 1)
    assert K.tail_plan(2, -(-3 * 57 * 57 // 128), K.P.sm_count())
    _assert_close(_run_kernel(cfg, x, w, b, g, dtype), want, dtype, "tail split, full size")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", DX_GEOMS)
def test_wgmma_dx_matches_reference(cfg, dtype, monkeypatch):
    """conv2d_backward's input gradient on the wgmma kernel (dx=wgmma) against the float64 cpu path."""
    _need_sm90()
    cp = backend.cupy
    N, Cc, H, W, O, k, p, d = cfg
    npdt = parse_dtype(dtype).np
    x, w, g, gy = _grad_case((N, Cc, H, W), (O, Cc, k, k), 1, p, d, dtype, 3)
    want, _ = C.im2col_backward(gy, x, w, g, True, False)
    spy = mock.Mock(wraps=K.conv_nhwc_wgmma)
    monkeypatch.setattr(K, "conv_nhwc_wgmma", spy)
    monkeypatch.setenv("FLAME_CONV_ALGO", "dx=wgmma")
    xd, wd, gd = (cp.asarray(a.astype(npdt)) for a in (x, w, gy))
    assert C.use_wgmma(xd, g, "dx")
    dx, dw = C.conv2d_backward(gd, xd, wd, g, need_x=True, need_w=False)
    assert dw is None and spy.call_count == 1
    _assert_close(cp.asnumpy(dx).astype(np.float64), want, dtype, f"dx {cfg}")


@pytest.mark.gpu
def test_wgmma_dx_strided_and_dilated_takes_im2col(monkeypatch):
    """A strided and dilated dx is neither a conv nor a set of phase convs: dx=wgmma leaves it to im2col (right
    numbers, no wgmma call). (A strided dx at dilation 1 runs per phase: tests/nn/test_conv_dx_phases.py.)"""
    _need_sm90()
    cp = backend.cupy
    x, w, g, gy = _grad_case((2, 24, 11, 10), (32, 24, 3, 3), 2, 2, 2, "float16", 4)
    want, _ = C.im2col_backward(gy, x, w, g, True, False)
    spy = mock.Mock(wraps=K.conv_nhwc_wgmma)
    monkeypatch.setattr(K, "conv_nhwc_wgmma", spy)
    monkeypatch.setenv("FLAME_CONV_ALGO", "dx=wgmma")
    xd, wd, gd = (cp.asarray(a.astype(np.float16)) for a in (x, w, gy))
    assert not C.use_wgmma(xd, g, "dx")
    dx, _ = C.conv2d_backward(gd, xd, wd, g, need_x=True, need_w=False)
    assert spy.call_count == 0
    _assert_close(cp.asnumpy(dx).astype(np.float64), want, "float16", "strided dilated dx")


# dw geometries (N, C, H, W, O, (KH, KW), (sh, sw), padding, (dh, dw)): ragged channels, batch 3, strides, dilation,
# a 1x1 with padding, 5x5, pixel counts not a multiple of the 64-pixel k-tile, rows narrower than a k-tile
DW_GEOMS = [
    (1, 13, 9, 7, 7, (3, 3), (1, 1), (1, 1), (1, 1)),
    (3, 40, 11, 13, 64, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 330, 9, 10, 200, (3, 3), (1, 1), (1, 1), (1, 1)),
    (3, 40, 15, 17, 136, (3, 3), (2, 2), (1, 1), (1, 1)),
    (1, 24, 13, 12, 20, (3, 3), (1, 1), (2, 2), (2, 2)),
    (1, 40, 9, 9, 130, (1, 1), (1, 1), (1, 1), (1, 1)),
    (2, 24, 10, 12, 16, (5, 5), (2, 2), (2, 2), (1, 1)),
    (1, 9, 7, 8, 10, (3, 2), (1, 1), (1, 0), (1, 2)),
    (2, 64, 20, 70, 72, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 8, 12, 12, 16, (7, 7), (1, 1), (3, 3), (1, 1)),      # 49 taps (dw keeps no tap masks)
]


@pytest.mark.gpu
@pytest.mark.parametrize("producers", ["1", "2"])
@pytest.mark.parametrize("tile", [None, "128x128", "128x256:s3", "128x128:s7"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", DW_GEOMS)
def test_wgmma_dw_matches_reference(cfg, dtype, tile, producers, monkeypatch):
    """conv2d_backward's weight gradient on the wgmma kernel (dw=wgmma) against the float64 cpu path, with the
    planned tile and forced tiles / splits over the pixels, with one and two producer warpgroups."""
    _need_sm90()
    monkeypatch.setenv("FLAME_CONV_DW_PRODUCERS", producers)
    monkeypatch.setenv("FLAME_CONV_TMA", "0")  # the cp.async gather (the TMA producer: its own test)
    cp = backend.cupy
    N, Cc, H, W, O, k, s, p, d = cfg
    npdt = parse_dtype(dtype).np
    x, w, g, gy = _grad_case((N, Cc, H, W), (O, Cc) + k, s, p, d, dtype, 5)
    _, want = C.im2col_backward(gy, x, w, g, False, True)
    spy = mock.Mock(wraps=K.conv_dw_nhwc_wgmma)
    monkeypatch.setattr(K, "conv_dw_nhwc_wgmma", spy)
    monkeypatch.setenv("FLAME_CONV_ALGO", "dw=wgmma")
    if tile:
        monkeypatch.setenv("FLAME_CONV_WGMMA_DW_TILE", tile)
    xd, wd, gd = (cp.asarray(a.astype(npdt)) for a in (x, w, gy))
    assert C.use_wgmma(xd, g, "dw")
    dx, dw = C.conv2d_backward(gd, xd, wd, g, need_x=False, need_w=True)
    assert dx is None and spy.call_count == 1 and dw.dtype == npdt
    _assert_close(cp.asnumpy(dw).astype(np.float64), want, dtype, f"dw {cfg} {tile}")


# weight-gradient geometries the TMA producer takes (input channels a multiple of 64; padding as (ph, pw)): ragged O
# (the second dY slab partly or wholly past Op), a K not a multiple of the tile (slabs past K skipped), odd sizes,
# batch 3, stride 2, dilation 2, a 1x1 with padding, a 5x5 at stride 2 and many pixel k-tiles
DW_TMA_GEOMS = [
    (3, 64, 11, 13, 70, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 128, 17, 15, 130, (3, 3), (2, 2), (1, 1), (1, 1)),
    (1, 192, 13, 12, 20, (3, 3), (1, 1), (2, 2), (2, 2)),
    (1, 64, 9, 9, 200, (1, 1), (1, 1), (1, 1), (1, 1)),
    (2, 64, 10, 12, 16, (5, 5), (2, 2), (2, 2), (1, 1)),
    (2, 320, 33, 31, 320, (3, 3), (1, 1), (1, 1), (1, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, "128x128", "128x256:s3", "128x128:s7"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", DW_TMA_GEOMS)
def test_wgmma_dw_tma_producer_matches_reference(cfg, dtype, tile, monkeypatch):
    """The weight gradient with the TMA producer (a tiled map of dY, an im2col map of x) against float64, with the
    planned and forced tiles / splits; and equal to the cp.async gather's."""
    _need_sm90()
    cp = backend.cupy
    N, Cc, H, W, O, k, s, p, d = cfg
    npdt = parse_dtype(dtype).np
    x, w, g, gy = _grad_case((N, Cc, H, W), (O, Cc) + k, s, p, d, dtype, 7)
    _, want = C.im2col_backward(gy, x, w, g, False, True)
    monkeypatch.setenv("FLAME_CONV_ALGO", "dw=wgmma")
    if tile:
        monkeypatch.setenv("FLAME_CONV_WGMMA_DW_TILE", tile)
    spy = mock.Mock(wraps=K.TMA.im2col_nhwc)
    monkeypatch.setattr(K.TMA, "im2col_nhwc", spy)
    xd, wd, gd = (cp.asarray(a.astype(npdt)) for a in (x, w, gy))
    got = {}
    for tma in ("1", "0"):
        monkeypatch.setenv("FLAME_CONV_TMA", tma)
        _, dw = C.conv2d_backward(gd, xd, wd, g, need_x=False, need_w=True)
        got[tma] = cp.asnumpy(dw).astype(np.float64)
        assert spy.call_count == 1  # the TMA run's map; the gather's run makes none
    _assert_close(got["1"], want, dtype, f"dw TMA {cfg} {tile}")
    np.testing.assert_allclose(got["1"], got["0"], rtol=0, atol=np.abs(want).max() * 2e-3)


@pytest.mark.gpu
def test_wgmma_dw_image_chunks_accumulate(monkeypatch):
    """Image chunks (a small workspace): each chunk's partials are added into one float32 sum, then rounded once."""
    _need_sm90()
    cp = backend.cupy
    x, w, g, gy = _grad_case((3, 40, 11, 13), (64, 40, 3, 3), 1, 1, 1, "float16", 6)
    _, want = C.im2col_backward(gy, x, w, g, False, True)
    spy = mock.Mock(wraps=K.conv_dw_nhwc_wgmma)
    monkeypatch.setattr(K, "conv_dw_nhwc_wgmma", spy)
    monkeypatch.setenv("FLAME_CONV_ALGO", "wgmma")
    monkeypatch.setenv("FLAME_CONV_WORKSPACE_MB", "0.03")
    xd, wd, gd = (cp.asarray(a.astype(np.float16)) for a in (x, w, gy))
    _, dw = C.conv2d_backward(gd, xd, wd, g, need_x=False, need_w=True)
    assert spy.call_count == 3
    _assert_close(cp.asnumpy(dw).astype(np.float64), want, "float16", "chunked dw")


@pytest.mark.gpu
def test_wgmma_training_step(monkeypatch):
    """F.conv2d with FLAME_CONV_ALGO=wgmma: the three passes on the wgmma kernels, against float64 (stride 1; the
    strided dx is tests/nn/test_conv_dx_phases.py)."""
    _need_sm90()
    monkeypatch.setenv("FLAME_CONV_ALGO", "wgmma")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 24, 12, 10))
    w = rng.standard_normal((40, 24, 3, 3)) * 0.1
    b = rng.standard_normal(40)
    gy = rng.standard_normal((2, 40, 12, 10))
    xr, wr = flame.tensor(x, device="cpu", requires_grad=True), flame.tensor(w, device="cpu", requires_grad=True)
    yr = F.conv2d(xr, wr, flame.tensor(b, device="cpu"), stride=1, padding=1)
    yr.backward(flame.tensor(gy, device="cpu"))
    dt = flame.bfloat16
    xt = flame.tensor(x, dtype=dt, device="cuda", requires_grad=True)
    wt = flame.tensor(w, dtype=dt, device="cuda", requires_grad=True)
    y = F.conv2d(xt, wt, flame.tensor(b, dtype=dt, device="cuda"), stride=1, padding=1)
    y.backward(flame.tensor(gy, dtype=dt, device="cuda"))
    for got, ref_, what in ((y, yr, "y"), (xt.grad, xr.grad, "dx"), (wt.grad, wr.grad, "dw")):
        a, r = got.detach().float().numpy().astype(np.float64), ref_.detach().numpy()
        assert np.abs(a - r).max() <= 3e-2 * np.abs(r).max(), what


@pytest.mark.gpu
def test_fwd_wgmma_off_hopper_raises(monkeypatch):
    """On a GPU other than compute capability 9.0 asking for the wgmma forward is an error, not a silent fallback."""
    if K.wgmma_available():
        pytest.skip("this GPU runs the wgmma kernel (the test above covers it)")
    cp = backend.cupy
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma")
    x = cp.zeros((1, 8, 6, 6), dtype=np.float16)
    g = C.geometry(x.shape, (8, 8, 3, 3), 1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        C.conv2d_forward(x, cp.zeros((8, 8, 3, 3), dtype=np.float16), g)


# ----------------------------------------------------------------------------- cpu
def test_conv_algo_parses_wgmma(monkeypatch):
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma")
    assert [C.conv_algo(p) for p in C.PASSES] == ["wgmma", "auto", "auto"]
    monkeypatch.setenv("FLAME_CONV_ALGO", "FWD=WGMMA+dx=igemm+dw=im2col")
    assert [C.conv_algo(p) for p in C.PASSES] == ["wgmma", "igemm", "im2col"]
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma,dx=wgmma")
    assert [C.conv_algo(p) for p in C.PASSES] == ["wgmma", "wgmma", "auto"]
    monkeypatch.setenv("FLAME_CONV_ALGO", "wgmma")
    assert [C.conv_algo(p) for p in C.PASSES] == ["wgmma", "wgmma", "wgmma"]
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma,dx=cudnn")  # a bad backward setting fails at the forward
    with pytest.raises(ValueError, match="must be one of"):
        C.conv_algo("fwd")


def test_fwd_wgmma_on_cpu_keeps_the_cpu_path(monkeypatch):
    """The setting selects a CUDA kernel: cpu arrays convolve exactly as without it."""
    rng = np.random.default_rng(0)
    x = flame.tensor(rng.standard_normal((2, 5, 7, 6)).astype(np.float32), device="cpu")
    w = flame.tensor(rng.standard_normal((4, 5, 3, 3)).astype(np.float32), device="cpu")
    b = flame.tensor(rng.standard_normal(4).astype(np.float32), device="cpu")
    monkeypatch.delenv("FLAME_CONV_ALGO", raising=False)
    want = F.conv2d(x, w, b, stride=2, padding=1).numpy()
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma")
    assert not C.use_wgmma(x.numpy(), C.geometry((2, 5, 7, 6), (4, 5, 3, 3), 2, 1, 1, 1))
    np.testing.assert_array_equal(F.conv2d(x, w, b, stride=2, padding=1).numpy(), want)


def test_wgmma_tile_and_split_choice(monkeypatch):
    monkeypatch.delenv("FLAME_CONV_WGMMA_TILE", raising=False)
    assert K.wgmma_plan(320, 2 * 128 * 128, 45, 132) == ("128x256", 45, 1)   # SDXL 128^2: 3 waves of 128x256
    assert K.wgmma_plan(640, 2 * 64 * 64, 90, 132) == ("128x128", 90, 1)     # SDXL 64^2: 320 CTAs of 128x128
    assert K.wgmma_plan(1280, 2 * 32 * 32, 180, 132) == ("128x256", 60, 3)   # SDXL 32^2: 80 CTAs, split in 3
    assert K.wgmma_plan(1280, 2 * 32 * 32, 180, 132, ws_budget=1 << 20)[2] == 1  # partials over the budget
    assert K.wgmma_tile(320, 2 * 128 * 128, 132) == "128x256"
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", "128x128")
    assert K.wgmma_plan(320, 2 * 128 * 128, 45, 132) == ("128x128", 45, 1)
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", "128x128:s4")
    assert K.wgmma_plan(320, 2 * 128 * 128, 45, 132) == ("128x128", 12, 4)
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", "128x256:s7")
    assert K.wgmma_plan(320, 1000, 10, 132) == ("128x256", 2, 5)             # no empty slices
    for bad in ("64x64", "128x128:s0", "128x128:sx"):
        monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", bad)
        with pytest.raises(ValueError, match="FLAME_CONV_WGMMA_TILE"):
            K.wgmma_plan(320, 1000, 10, 132)


def test_tail_split_plan():
    assert K.split_tail("128x128:t3") == ("128x128:s1", 3)
    assert K.split_tail("128x256:s2") == ("128x256:s2", 0) and K.split_tail(None) == (None, 0)
    for bad in ("128x128:t1", "128x128:tx"):
        with pytest.raises(ValueError, match="tail"):
            K.split_tail(bad)
    assert K.tail_plan(5, 64, 132) == 52      # SDXL 2x640x64^2, 128x128: 320 tiles, 260 in two waves, 60 in the tail
    assert K.tail_plan(5, 20, 132) == 0       # under one wave: nothing to split off
    assert K.tail_plan(1, 264, 132) == 0      # whole waves: no tail
    assert K.tail_plan(3, 100, 132) == 88     # 300 tiles: 264 -> 88 whole pixel tiles of 3 channel tiles


def test_wgmma_smem_fits_sm90():
    for name in K.WGMMA_TILES:  # 227 KiB of dynamic shared memory per block on the H100 / H200, 3136 B static
        assert K.wgmma_smem(name) + 3136 <= 232448, name


@pytest.mark.gpu
def test_kernels_of_more_than_32_taps_take_the_mma_sync_kernel(monkeypatch):
    """The wgmma kernel keeps each pixel row's in-image taps in a 32-bit mask: a 7x7 conv under fwd=wgmma runs the
    mma.sync implicit GEMM (right numbers), and the kernel itself refuses it."""
    _need_sm90()
    cp = backend.cupy
    cfg = (1, 16, 12, 12, 24, (7, 7), (1, 1), (3, 3, 3, 3), (1, 1))
    x, w, b, g, want = _case(cfg, "bfloat16", seed=2)
    npdt = parse_dtype("bfloat16").np
    xd, wd = (cp.asarray(a.astype(npdt)) for a in (x, w))
    gs = C.geometry(x.shape, w.shape, 1, 3, 1, 1)
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=wgmma")
    assert C.use_igemm(xd, gs) and not C.use_wgmma(xd, gs)
    _assert_close(cp.asnumpy(C.conv2d_forward(xd, wd, gs)).astype(np.float64), want, "bfloat16", "7x7")
    Cp = K.round8(16)
    cg = K.ConvGeom(1, 12, 12, Cp, 24, g.OH, g.OW, 7, 7, 1, 1, 3, 3, 1, 1)
    out = cp.empty((1, 24, g.OH, g.OW), dtype=npdt)
    with pytest.raises(ValueError, match="more than 32 taps"):
        K.conv_nhwc_wgmma(K.to_nhwc(xd, Cp), K.pack_weight(wd, Cp), out, cg)
