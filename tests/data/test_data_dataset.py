"""ImageDataset: several folders with their own settings, repeats, flips, crops, sizes, and bad input found
before any model is loaded."""
import os

import numpy as np
import pytest
from make_images import write_caption, write_image
from PIL import Image

from flame_models.data import Bucket, DataError, DatasetConfig, ImageDataset, image_array, load_image


def test_several_folders_with_their_own_settings(tmp_path, folder):
    other = tmp_path / "other"
    for i in range(3):
        write_caption(write_image(str(other / f"o{i}.jpg"), 300, 200, seed=10 + i, fmt="JPEG"), f"style {i}")
    cfgs = [DatasetConfig(folder_path=folder, resolution=[128, 256], num_repeats=2),
            DatasetConfig(folder_path=str(other), resolution=128, flip_x=True, trigger_word="zzk",
                          default_caption="unused")]
    ds = ImageDataset(cfgs, seed=1, trigger_word="ohwx", progress=False)
    assert len(ds.records) == 8
    assert len(ds) == 5 * 2 * 2 + 3 * 2 * 1                    # images x repeats x resolutions (x flips)
    by_cfg = [[i for i in range(len(ds)) if ds.samples[i].config == c] for c in (0, 1)]
    assert {ds.caption(i, 0).split()[0] for i in by_cfg[0]} == {"ohwx"}
    assert {ds.caption(i, 0).split()[0] for i in by_cfg[1]} == {"zzk"}
    assert sum(ds.samples[i].flip_x for i in by_cfg[1]) == 3
    assert {ds.samples[i].resolution for i in by_cfg[1]} == {128}
    for b, idx in ds.buckets().items():
        assert {ds.samples[i].bucket for i in idx} == {b}
    assert ds.summary()[0] == "8 images, 26 samples per epoch in 4 buckets"
    assert ds.fingerprint() == ImageDataset(cfgs, seed=1, trigger_word="ohwx", progress=False).fingerprint()
    assert ds.fingerprint() != ImageDataset(cfgs, seed=2, trigger_word="ohwx", progress=False).fingerprint()


def test_pixels_sizes_and_flips(tmp_path):
    root = tmp_path / "p"
    path = write_image(str(root / "wide.png"), 400, 200)
    write_caption(path, "wide")
    ds = ImageDataset([DatasetConfig(folder_path=str(root), resolution=128, flip_x=True, flip_y=True,
                                     random_crop=True)], seed=3, progress=False)
    assert len(ds) == 3
    plain, fx, fy = (next(i for i in range(3) if (ds.samples[i].flip_x, ds.samples[i].flip_y) == f)
                     for f in ((False, False), (True, False), (False, True)))
    b = ds.samples[plain].bucket
    assert b == Bucket(192, 64) and ds.target_size(plain) == (64, 192) and ds.original_size(plain) == (200, 400)
    p = ds.latent_spec(plain).pixels()
    assert p.shape == (3, 64, 192) and p.dtype == np.float32 and -1 <= p.min() and p.max() <= 1
    # the same crop, by hand: cover-resize 400x200 -> 192x96... then crop (top, left)
    pl = ds.samples[plain].placement
    top, left = pl.crop
    ref = load_image(path).resize(pl.resized, Image.Resampling.LANCZOS).crop((left, top, left + 192, top + 64))
    np.testing.assert_array_equal(p, image_array(ref))
    for i, axis in ((fx, 2), (fy, 1)):                         # flipped samples: their own crop, mirrored
        sp = ds.samples[i].placement
        t, l = sp.crop
        own = load_image(path).resize(sp.resized, Image.Resampling.LANCZOS).crop((l, t, l + 192, t + 64))
        np.testing.assert_array_equal(ds.latent_spec(i).pixels(), np.flip(image_array(own), axis))
    t, l = ds.crop_coords(fx)                                  # the crop in the mirrored image's frame
    sp = ds.samples[fx].placement
    assert (t, l) == (sp.crop[0], sp.resized[0] - sp.crop[1] - 192)


def test_random_crop_is_drawn_per_sample_and_seed(tmp_path):
    root = tmp_path / "r"
    write_caption(write_image(str(root / "tall.png"), 64, 400), "tall")
    crops = lambda seed, rc=True: [ds.samples[i].placement.crop for ds in [ImageDataset(  # noqa: E731
        [DatasetConfig(folder_path=str(root), resolution=128, num_repeats=6, random_crop=rc)], seed=seed,
        progress=False)] for i in range(6)]
    a = crops(0)
    assert a == crops(0) and a != crops(1)
    assert len(set(a)) > 1 and all(0 <= t <= 400 - 256 and l == 0 for t, l in a)   # 64x400 -> bucket 64x256 of 128
    assert set(crops(0, rc=False)) == {(72, 0)}


def test_bad_inputs_fail_before_training_naming_each_file(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError, match=r"datasets\[0\]\.folder_path: no such folder: .*nope"):
        ImageDataset([DatasetConfig(folder_path=missing)], progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no images")
    with pytest.raises(DataError, match=r"datasets\[0\]\.folder_path: .*empty holds no images"):
        ImageDataset([DatasetConfig(folder_path=str(empty))], progress=False)

    root = tmp_path / "bad"
    write_caption(write_image(str(root / "good.png"), 128, 128), "fine")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    write_caption(str(root / "broken.jpg"), "broken")
    write_caption(write_image(str(root / "latin.png"), 128, 128, seed=1), "caf\u00e9".encode("latin-1"))
    write_caption(write_image(str(root / "sub" / "small.png"), 40, 40, seed=2), "small")
    with pytest.raises(DataError) as ex:
        ImageDataset([DatasetConfig(folder_path=str(root), resolution=64)], progress=False)
    msg = str(ex.value)                                        # all three at once, each naming its file
    assert "3 unusable file(s)" in msg and "broken.jpg: cannot read the image" in msg
    assert "latin.txt: the caption file is not UTF-8" in msg
    assert "sub/small.png: 40x40 is smaller than its 64x64 bucket at resolution 64" in msg
    os.remove(root / "broken.jpg")
    write_caption(str(root / "latin.png"), "cafe")
    write_image(str(root / "nocap.png"), 64, 64, seed=3)
    with pytest.raises(DataError, match=r"2 unusable(.|\n)*nocap\.png: no caption file nocap\.txt(.|\n)*small\.png"):
        ImageDataset([DatasetConfig(folder_path=str(root), resolution=64)], progress=False)
    os.remove(root / "nocap.png")
    ds = ImageDataset([DatasetConfig(folder_path=str(root), resolution=64, allow_upscale=True)], progress=False)
    assert len(ds) == 3

    with pytest.raises(DataError, match=r"datasets\[1\]\.resolution: 100 is not a multiple of bucket_tolerance 64"):
        ImageDataset([DatasetConfig(folder_path=str(root)), DatasetConfig(folder_path=str(root), resolution=100)],
                     progress=False)


def test_probe_index_is_used_when_caching_to_disk(tmp_path, monkeypatch):
    root = tmp_path / "idx"
    for i in range(3):
        p = write_image(str(root / f"i{i}.png"), 64, 64, seed=i)
        write_caption(p, f"c{i}")
        os.utime(p, (1e9, 1e9))                               # written long ago: not "racy"
    cfg = DatasetConfig(folder_path=str(root), resolution=64, cache_latents_to_disk=True)
    from flame_models.data import images as I
    calls = []
    real = I.probe_image
    monkeypatch.setattr(I, "probe_image", lambda *a: calls.append(a[0]) or real(*a))
    first = ImageDataset([cfg], progress=False)
    assert len(calls) == 3 and os.path.isfile(root / ".flame_cache" / "images.json")
    second = ImageDataset([cfg], progress=False)
    assert len(calls) == 3 and second.records == first.records and second.fingerprint() == first.fingerprint()
    write_image(str(root / "i1.png"), 64, 64, seed=9)
    third = ImageDataset([cfg], progress=False)
    assert calls[3:] == [str(root / "i1.png")] and third.records[1].sha256 != first.records[1].sha256
    ImageDataset([DatasetConfig(folder_path=str(root), resolution=64)], progress=False)   # no disk cache: no index
    assert len(calls) == 7
