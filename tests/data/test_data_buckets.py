"""Aspect-ratio buckets: sizes, assignment, cover-resize and crop, never upscaling unless allowed."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from make_images import write_caption, write_image
from PIL import Image

from flame_models.data import DataError, DatasetConfig, ImageDataset
from flame_models.data.buckets import MAX_ASPECT, Bucket, closest_bucket, cover_scale, make_buckets, place

resolutions = st.sampled_from([64, 128, 256, 320, 512, 640, 768, 1024, 1536, 2048])
sides = st.integers(16, 6000)


def test_known_bucket_sets():
    b512 = make_buckets(512)
    assert [str(b) for b in b512 if b.width >= b.height] == [
        "512x512", "576x448", "640x384", "704x320", "768x320", "832x256", "896x256", "960x256", "1024x256"]
    b1024 = make_buckets(1024)
    assert len(b1024) == 33
    for name in ("1024x1024", "1088x960", "1216x832", "1344x768", "1536x640", "2048x512", "512x2048"):
        assert Bucket(*map(int, name.split("x"))) in b1024
    assert make_buckets(64) == [Bucket(64, 64)]


@given(r=resolutions, step=st.sampled_from([32, 64]))
def test_bucket_sizes(r, step):
    if r % step:
        with pytest.raises(ValueError):
            make_buckets(r, step)
        return
    bs = make_buckets(r, step)
    area = r * r
    assert Bucket(r, r) in bs
    assert len(set(bs)) == len(bs)
    for b in bs:
        assert b.width % step == 0 and b.height % step == 0 and b.width >= step and b.height >= step
        assert b.width * b.height <= area                               # never more pixels than r²
        assert b.width * b.height > area - step * max(b)                # the largest height the step allows
        assert max(b.aspect, 1 / b.aspect) <= MAX_ASPECT
        assert Bucket(b.height, b.width) in bs                          # portrait and landscape alike


def _log_gaps(bs):
    la = sorted(math.log(b.aspect) for b in bs)
    return max(y - x for x, y in zip(la, la[1:])) if len(la) > 1 else 0.0


@given(w=sides, h=sides, r=resolutions)
def test_closest_bucket_is_closest_and_error_is_bounded(w, h, r):
    bs = make_buckets(r)
    b = closest_bucket(w, h, bs)
    err = abs(math.log(b.aspect) - math.log(w / h))
    assert all(err <= abs(math.log(o.aspect) - math.log(w / h)) + 1e-12 for o in bs)
    lo, hi = min(x.aspect for x in bs), max(x.aspect for x in bs)
    if lo <= w / h <= hi:
        assert err <= _log_gaps(bs) / 2 + 1e-12
    else:                                                                # beyond the aspect limit: the extreme
        assert b.aspect in (lo, hi)


def test_aspect_error_at_common_resolutions():
    # half the widest gap between neighbouring bucket aspects, in log ratio: the worst aspect change of a crop
    assert _log_gaps(make_buckets(512)) / 2 < 0.16
    assert _log_gaps(make_buckets(768)) / 2 < 0.11
    assert _log_gaps(make_buckets(1024)) / 2 < 0.08


@given(w=st.integers(16, 3000), h=st.integers(16, 3000), r=st.sampled_from([64, 128, 256, 512, 1024]),
       seed=st.integers(0, 2 ** 31), random_crop=st.booleans())
def test_cover_resize_then_crop_gives_the_bucket(w, h, r, seed, random_crop):
    b = closest_bucket(w, h, make_buckets(r))
    p = place(w, h, b, np.random.default_rng(seed) if random_crop else None)
    rw, rh = p.resized
    assert rw >= b.width and rh >= b.height                             # covers the bucket
    assert rw == b.width or rh == b.height                              # ... and no more than needed
    assert abs(rw - w * p.scale) <= 0.5 + 1e-6 and abs(rh - h * p.scale) <= 0.5 + 1e-6
    top, left = p.crop
    assert 0 <= top <= rh - b.height and 0 <= left <= rw - b.width
    if not random_crop:
        assert top == (rh - b.height) // 2 and left == (rw - b.width) // 2
    assert p.upscales == (w < b.width or h < b.height)                 # upscaling only when it must
    assert p.scale == pytest.approx(cover_scale(w, h, b))


@given(w=st.integers(8, 160), h=st.integers(8, 160), seed=st.integers(0, 1000))
def test_pil_resize_and_crop_has_the_bucket_size(w, h, seed):
    b = closest_bucket(w, h, make_buckets(64, 32))
    p = place(w, h, b, np.random.default_rng(seed))
    im = Image.new("RGB", (w, h)).resize(p.resized, Image.Resampling.LANCZOS)
    top, left = p.crop
    assert im.crop((left, top, left + b.width, top + b.height)).size == (b.width, b.height)


def test_small_image_is_an_error_naming_it_unless_upscale_allowed(tmp_path):
    root = tmp_path / "small"
    write_caption(write_image(str(root / "ok.png"), 600, 600), "fine")
    small = write_image(str(root / "tiny.png"), 500, 300, seed=1)
    write_caption(small, "too small")
    with pytest.raises(DataError, match=r"tiny\.png: 500x300 is smaller than its 640x384 bucket at resolution 512"):
        ImageDataset([DatasetConfig(folder_path=str(root), resolution=512)], progress=False)
    ds = ImageDataset([DatasetConfig(folder_path=str(root), resolution=512, allow_upscale=True)], progress=False)
    tiny = [i for i in range(len(ds)) if ds.record(i).relpath == "tiny.png"]
    assert len(tiny) == 1 and ds.samples[tiny[0]].placement.upscales
    assert ds.latent_spec(tiny[0]).pixels().shape == (3, 384, 640)


def test_image_too_small_for_a_larger_resolution_is_kept_at_the_smaller(tmp_path):
    root = tmp_path / "mixed"
    write_caption(write_image(str(root / "big.png"), 1100, 1100), "big")
    write_caption(write_image(str(root / "mid.png"), 700, 700, seed=1), "mid")
    ds = ImageDataset([DatasetConfig(folder_path=str(root), resolution=[512, 1024])], progress=False)
    got = sorted((ds.record(i).relpath, ds.samples[i].resolution) for i in range(len(ds)))
    assert got == [("big.png", 512), ("big.png", 1024), ("mid.png", 512)]
    assert any("not trained at 1024" in w and "mid.png" in w for w in ds.warnings)
    for i in range(len(ds)):
        assert not ds.samples[i].placement.upscales
