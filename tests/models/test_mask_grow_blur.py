"""The inpainting mask's grow and blur (flame_models/samplers/inpaint.py: grow_mask, read_mask's grow= / blur=)
against their references: ComfyUI's GrowMask as it computes (scipy's grey_dilation / grey_erosion, a 3 x 3 footprint
per pixel) and diffusers' VaeImageProcessor.blur (Pillow's GaussianBlur), from tests/fixtures/make_mask_fixtures.py;
the order (grow, then blur, at the mask's own size, then the fit) and the bounds."""
import os

import numpy as np
import pytest
from PIL import Image, ImageFilter, ImageOps
from safetensors.numpy import load_file

from flame_models.samplers.inpaint import MAX_BLUR, MAX_GROW, check_blur, check_grow, grow_mask, read_mask

FIX = load_file(os.path.join(os.path.dirname(__file__), "..", "fixtures", "inpaint_masks", "masks.safetensors"))
MASK = FIX["mask"]
GROWS = sorted(k for k in FIX if k.startswith("grow_"))
BLURS = sorted(k for k in FIX if k.startswith("blur_"))


def test_the_fixture_has_every_case():
    assert len(GROWS) == 6 and len(BLURS) == 3 and MASK.shape == (29, 37)


@pytest.mark.parametrize("key", GROWS)
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_grow_is_comfyui_growmask(key, dtype):
    _, expand, kind = key.split("_")
    m = MASK if dtype is np.uint8 else MASK.astype(np.float32) / 255.0
    out = grow_mask(m, int(expand), tapered_corners=kind == "tapered")
    assert out.dtype == m.dtype and out.shape == m.shape
    got = out.astype(np.float32) / 255.0 if dtype is np.uint8 else out
    np.testing.assert_array_equal(got, FIX[key])
    assert np.array_equal(m, MASK if dtype is np.uint8 else MASK.astype(np.float32) / 255.0)   # (a new array)


def test_grow_zero_and_saturation():
    np.testing.assert_array_equal(grow_mask(MASK, 0), MASK)
    # more passes than H + W change nothing more: the whole mask takes its maximum (its minimum when shrinking)
    assert (grow_mask(MASK, MAX_GROW) == MASK.max()).all()
    assert (grow_mask(MASK, -MAX_GROW) == MASK.min()).all()


@pytest.mark.parametrize("key", BLURS)
def test_blur_is_diffusers_mask_blur(tmp_path, key):
    path = tmp_path / "m.png"
    Image.fromarray(MASK, "L").save(path)
    h, w = MASK.shape
    got = read_mask(str(path), w, h, blur=float(key[5:]))       # the mask's own size: the fit changes nothing
    np.testing.assert_array_equal(np.round(got * 255).astype(np.uint8), FIX[key])


def test_grow_then_blur_at_the_mask_size_then_the_fit(tmp_path):
    path = tmp_path / "m.png"
    Image.fromarray(MASK, "L").save(path)
    got = read_mask(str(path), 24, 16, grow=3, blur=1)
    grown = Image.fromarray(grow_mask(MASK, 3), "L")   # (the fixture's case grow_3_tapered)
    want = ImageOps.fit(grown.filter(ImageFilter.GaussianBlur(1.0)), (24, 16), Image.LANCZOS)
    np.testing.assert_array_equal(got, np.asarray(want, np.float32) / 255.0)
    # a PIL image given in memory: the same
    np.testing.assert_array_equal(read_mask(Image.open(path), 24, 16, grow=3, blur=1), got)
    # shrinking a white square away leaves nothing to repaint
    sq = np.zeros((20, 20), np.uint8)
    sq[8:12, 8:12] = 255
    Image.fromarray(sq).save(path)
    assert read_mask(str(path), 20, 20, grow=-2).max() == 0.0
    assert read_mask(str(path), 20, 20, grow=-1).sum() == 4.0


@pytest.mark.parametrize("bad", [1.5, -MAX_GROW - 1, MAX_GROW + 1, True, "3", None, float("nan")])
def test_bad_grow_is_refused(bad):
    with pytest.raises(ValueError, match=r"grow: whole pixels in \[-256, 256\]"):
        check_grow(bad)


@pytest.mark.parametrize("bad", [-0.5, MAX_BLUR + 1, float("nan"), float("inf"), True, "x", None])
def test_bad_blur_is_refused(bad):
    with pytest.raises(ValueError, match=r"blur: a radius in pixels in \[0, 256\]"):
        check_blur(bad)


def test_bad_values_are_refused_before_the_image_is_read(tmp_path):
    missing = str(tmp_path / "missing.png")   # never opened: the values fail first
    with pytest.raises(ValueError, match="grow"):
        read_mask(missing, 8, 8, grow=2.5)
    with pytest.raises(ValueError, match="blur"):
        read_mask(missing, 8, 8, blur=-1)
    with pytest.raises(ValueError, match=r"shape \(H, W\)"):
        grow_mask(np.zeros((2, 3, 4)), 1)
