"""conv2d's per-pass algorithm switch and the implicit-GEMM tile planner (pure Python: runs without a GPU)."""
import pytest

from flame_core.kernels import conv as K
from flame_core.ops import conv as C

SMS, BUDGET = 132, 512 << 20  # H100


def _fwd(N, Cc, H, W, O):
    P, Kd = N * H * W, 9 * Cc
    return K._plan(O, P, -(-Kd // K.BK), O * P, False, BUDGET, None, SMS, K.FWD)


def test_conv_algo_parsing(monkeypatch):
    monkeypatch.delenv("FLAME_CONV_ALGO", raising=False)
    assert [C.conv_algo(p) for p in C.PASSES] == ["auto"] * 3
    monkeypatch.setenv("FLAME_CONV_ALGO", "IGEMM")
    assert [C.conv_algo(p) for p in C.PASSES] == ["igemm"] * 3
    for spec in ("fwd=igemm,dw=im2col", "fwd=igemm;dw=im2col", "fwd=igemm/dw=im2col", "fwd=igemm+dw=im2col"):
        monkeypatch.setenv("FLAME_CONV_ALGO", spec)
        assert [C.conv_algo(p) for p in C.PASSES] == ["igemm", "auto", "im2col"]
    monkeypatch.setenv("FLAME_CONV_ALGO", "bwd=igemm")
    with pytest.raises(ValueError):
        C.conv_algo("fwd")
    monkeypatch.setenv("FLAME_CONV_ALGO", "fwd=cudnn")
    with pytest.raises(ValueError):
        C.conv_algo("fwd")


def test_im2col_threshold_env(monkeypatch):
    monkeypatch.delenv("FLAME_CONV_IM2COL_MAX_MB", raising=False)
    assert C.im2col_max_bytes() == C.IM2COL_MAX_BYTES
    monkeypatch.setenv("FLAME_CONV_IM2COL_MAX_MB", "32")
    assert C.im2col_max_bytes() == 32 << 20 != C.IM2COL_MAX_BYTES


def test_plan_sdxl_tiles():
    """SDXL channel counts (320, 640, 1280) take tiles whose 320 / 160 rows divide them (no wasted rows)."""
    for shape in [(2, 320, 128, 128, 320), (2, 640, 64, 64, 640)]:
        name, kps, S = _fwd(*shape)
        assert name in ("320x128", "160x256") and S == 1, (shape, name, S)
    name, _, _ = _fwd(2, 1280, 32, 32, 1280)
    assert K.TILES[name][0] in (160, 320)


def test_plan_tile_kinds_and_smem():
    # dw never plans a forward-only tile; a device with less shared memory never gets the 224 KiB tile
    P = 2 * 128 * 128
    name, _, _ = K._plan(320, 2880, -(-P // K.BK), 320 * 2880, True, BUDGET, None, SMS, K.DW)
    assert K.DW in K.TILES[name][7]
    name, _, _ = K._plan(320, P, 45, 320 * P, False, BUDGET, None, SMS, K.FWD, 166912)  # A100: 163 KiB
    assert K.tile_smem(name) <= 166912
    with pytest.raises(ValueError):
        K._plan(320, 2880, 512, 320 * 2880, True, BUDGET, "320x128", SMS, K.DW)
    assert K._plan(320, P, 45, 320 * P, False, BUDGET, "320x128:s3", SMS, K.FWD) == ("320x128", 15, 3)


def test_forced_tile_env(monkeypatch):
    monkeypatch.delenv("FLAME_CONV_DW_TILE", raising=False)
    monkeypatch.setenv("FLAME_CONV_TILE", "320x128")
    assert K.forced_tile(K.FWD) == "320x128" and K.forced_tile(K.DW) is None
    monkeypatch.setenv("FLAME_CONV_TILE", "128x256:s2")
    assert K.forced_tile(K.DW) == "128x256:s2"
    monkeypatch.setenv("FLAME_CONV_DW_TILE", "64x128")
    assert K.forced_tile(K.DW) == "64x128"


def test_smem_fits_sm90():
    for name in K.TILES:
        assert K.tile_smem(name) <= 232448, name
    assert K.tile_smem("320x128") == 4 * 448 * 128


@pytest.mark.parametrize("var, fn", [("FLAME_CONV_DW_PRODUCERS", "dw_producers"),
                                     ("FLAME_CONV_FWD_PRODUCERS", "fwd_producers")])
def test_producers_switch(monkeypatch, var, fn):
    """FLAME_CONV_DW_PRODUCERS / FLAME_CONV_FWD_PRODUCERS pick the wgmma kernels' producer warpgroups (1 or 2);
    anything else is refused by name."""
    from flame_core.kernels import conv as K
    get = getattr(K, fn)
    monkeypatch.delenv(var, raising=False)
    assert get() == (K.WGMMA_DW_PRODUCERS if fn == "dw_producers" else K.WGMMA_FWD_PRODUCERS)
    for v in ("1", "2"):
        monkeypatch.setenv(var, v)
        assert get() == int(v)
    monkeypatch.setenv(var, "3")
    with pytest.raises(ValueError, match=f"{var} must be 1 or 2, got '3'"):
        get()
