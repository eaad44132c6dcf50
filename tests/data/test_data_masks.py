"""Loss masks of image datasets (mask_path, alpha_mask, invert_mask, mask_min_value): placed exactly as their images
across buckets, crops and flips, reduced to the latent grid by the area mean, cached under a key that follows the
mask file, and every bad input named before any model."""
import os

import numpy as np
import pytest
from make_images import write_caption, write_image
from PIL import Image

from flame_models.data import DataError, DatasetConfig, ImageDataset, LatentCache
from flame_models.data.config import validate_dataset_config
from flame_models.data.masks import MaskCache, read_mask

SIZES = [(320, 256), (256, 320), (256, 256), (512, 256), (384, 288)]


def _gray_pairs(tmp_path, sizes=SIZES, mask_scale=1):
    """Images of gray noise and, as their masks, the same gray levels (`mask_scale`: masks saved that much
    smaller)."""
    images, masks = tmp_path / "images", tmp_path / "masks"
    masks.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(sizes):
        g = rng.integers(0, 256, (h, w), dtype=np.uint8)
        os.makedirs(images, exist_ok=True)
        Image.fromarray(g, "L").save(images / f"img{i}.png")
        write_caption(str(images / f"img{i}.png"), f"thing {i}")
        m = Image.fromarray(g, "L")
        if mask_scale != 1:
            m = m.resize((w // mask_scale, h // mask_scale), Image.Resampling.BOX)
        m.save(masks / f"img{i}.png")
    return str(images), str(masks)


def test_a_mask_is_placed_exactly_as_its_image_across_buckets_crops_and_flips(tmp_path):
    images, masks = _gray_pairs(tmp_path)
    ds = ImageDataset([DatasetConfig(folder_path=images, mask_path=masks, resolution=[128, 256], random_crop=True,
                                     flip_x=True, flip_y=True, bucket_tolerance=32)], seed=5, progress=False)
    assert len({s.bucket for s in ds.samples}) >= 4 and len({s.placement.crop for s in ds.samples}) > 3
    for i in range(len(ds)):
        gray = (ds.latent_spec(i).pixels()[0] + 1.0) / 2.0               # the image as the VAE gets it, in [0, 1]
        mask = ds.mask_spec(i).pixels()
        assert mask.shape == gray.shape
        # the same pixels (one pixel of misalignment on noise is ~0.3 off)
        np.testing.assert_allclose(mask, gray, rtol=0, atol=1e-6, err_msg=str(ds.samples[i]))


def test_a_smaller_mask_of_the_same_aspect_is_stretched_onto_its_image(tmp_path):
    images, masks = _gray_pairs(tmp_path, sizes=[(256, 256), (384, 256)], mask_scale=2)
    ds = ImageDataset([DatasetConfig(folder_path=images, mask_path=masks, resolution=128, flip_x=True)],
                      progress=False)
    for i in range(len(ds)):
        w = ds.mask_spec(i).weights()[0]                                 # 8x8 area means hide the lost detail
        gray = (ds.latent_spec(i).pixels()[0] + 1.0) / 2.0
        ref = gray.reshape(w.shape[0], 8, w.shape[1], 8).mean(axis=(1, 3))
        np.testing.assert_allclose(w, ref, atol=0.02)


def test_latent_weights_are_the_area_mean_mapped_to_the_min_value(tmp_path):
    root, mdir = tmp_path / "images", tmp_path / "masks"
    write_caption(write_image(str(root / "a.png"), 64, 64, seed=1), "a")
    rng = np.random.default_rng(3)
    m = rng.integers(0, 256, (64, 64), dtype=np.uint8)
    os.makedirs(mdir)
    Image.fromarray(m, "L").save(mdir / "a.png")
    cfg = dict(folder_path=str(root), mask_path=str(mdir), resolution=64, bucket_tolerance=32, flip_x=True)
    ds = ImageDataset([DatasetConfig(**cfg, mask_min_value=0.25)], progress=False)
    plain, flipped = (next(i for i in range(len(ds)) if ds.samples[i].flip_x == f) for f in (False, True))
    spec = ds.mask_spec(plain)
    assert spec.resized == (64, 64) and spec.crop == (0, 0)              # the 64x64 bucket: no resize, no crop
    # NumPy in float64: 8x8 block means of m / 255, mapped to [0.25, 1]
    ref = 0.25 + 0.75 * (m / 255.0).reshape(8, 8, 8, 8).mean(axis=(1, 3))
    w = spec.weights()
    assert w.shape == (1, 8, 8) and w.dtype == np.float32
    np.testing.assert_allclose(w[0], ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ds.mask_spec(flipped).weights()[0], ref[:, ::-1], rtol=0, atol=1e-6)
    inv = ImageDataset([DatasetConfig(**cfg, invert_mask=True)], progress=False)
    np.testing.assert_allclose(inv.mask_spec(plain).weights()[0], 1 - (m / 255.0).reshape(8, 8, 8, 8).mean(
        axis=(1, 3)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ds.mask_spec(plain, factor=16).weights()[0],                # another VAE factor
                               0.25 + 0.75 * (m / 255.0).reshape(4, 16, 4, 16).mean(axis=(1, 3)), rtol=0, atol=1e-6)


def test_alpha_masks_and_sixteen_bit_masks(tmp_path):
    root = tmp_path / "images"
    a = np.zeros((64, 64, 4), np.uint8)
    a[..., :3] = 200
    a[:, 32:, 3] = 255                                                  # opaque right half
    os.makedirs(root)
    Image.fromarray(a, "RGBA").save(root / "cut.png")
    write_caption(str(root / "cut.png"), "cut")
    write_caption(write_image(str(root / "opaque.png"), 64, 64, seed=2), "opaque")   # no alpha: weight 1
    ds = ImageDataset([DatasetConfig(folder_path=str(root), alpha_mask=True, resolution=64, bucket_tolerance=32)],
                      progress=False)
    by_name = {os.path.basename(ds.record(i).path): ds.mask_spec(i).weights()[0] for i in range(len(ds))}
    np.testing.assert_array_equal(by_name["cut.png"][:, :4], 0)
    np.testing.assert_array_equal(by_name["cut.png"][:, 4:], 1)
    np.testing.assert_array_equal(by_name["opaque.png"], 1)
    deep = tmp_path / "deep.png"
    Image.fromarray(np.full((8, 8), 65535 // 4, np.uint16)).save(deep)   # 16-bit grey: by its bit depth
    np.testing.assert_array_equal(read_mask(str(deep)), 64)                # round(16383 * 255 / 65535)


def test_an_edited_mask_gets_a_new_cache_entry_and_the_latents_stay(tmp_path):
    images, masks = _gray_pairs(tmp_path, sizes=[(64, 64), (128, 64)])
    cfg = dict(folder_path=images, mask_path=masks, resolution=64, bucket_tolerance=32, cache_latents_to_disk=True)
    ds = ImageDataset([DatasetConfig(**cfg)], progress=False)
    cache = MaskCache()
    specs = ds.mask_specs()
    assert cache.fill(specs, progress=False) == 2 and cache.missing(specs) == []
    folder = os.path.join(images, ".flame_cache", "masks")
    assert len(os.listdir(folder)) == 2                                 # beside the latents, on disk
    assert MaskCache().missing(specs) == []                             # a new run finds them
    latents = LatentCache("enc")
    latents.fill(ds.latent_specs(), lambda px: px[:, :1, ::8, ::8], progress=False)
    before = cache.load(specs[0])
    Image.fromarray(np.zeros((64, 64), np.uint8), "L").save(os.path.join(masks, "img0.png"))    # edit one mask
    ds2 = ImageDataset([DatasetConfig(**cfg)], progress=False)
    specs2 = ds2.mask_specs()
    assert [s.path for s in cache.missing(specs2)] == [specs2[0].path]   # only the edited one
    assert latents.missing(ds2.latent_specs()) == []                    # no VAE work for a mask edit
    cache.fill(specs2, progress=False)
    np.testing.assert_array_equal(cache.load(specs2[0]), 0)
    assert before.any()
    assert ds2.fingerprint() != ds.fingerprint()                        # a run's data changed: no silent resume
    inv = ImageDataset([DatasetConfig(**cfg, invert_mask=True)], progress=False)
    assert len(cache.missing(inv.mask_specs())) == 2                    # settings are part of the key too


def test_missing_masks_train_with_weight_one_and_are_named(tmp_path):
    images, masks = _gray_pairs(tmp_path, sizes=[(64, 64), (64, 64), (64, 64)])
    os.remove(os.path.join(masks, "img1.png"))
    ds = ImageDataset([DatasetConfig(folder_path=images, mask_path=masks, resolution=64, bucket_tolerance=32)],
                      progress=False)
    assert any("datasets[0].mask_path: 1 image(s) have no mask" in w and "img1.png" in w for w in ds.warnings)
    missing = [i for i in range(len(ds)) if ds.mask_spec(i) is None]
    assert [os.path.basename(ds.record(i).path) for i in missing] == ["img1.png"]
    assert ds.has_masks


def test_bad_masks_and_mask_settings_are_named(tmp_path):
    images, masks = _gray_pairs(tmp_path, sizes=[(64, 64), (128, 64)])
    Image.fromarray(np.zeros((64, 64), np.uint8)).save(os.path.join(masks, "img1.png"))   # 1:1 for a 2:1 image
    with pytest.raises(DataError, match=r"img1.png: a 64x64 mask for the 128x64 image .*another aspect ratio"):
        ImageDataset([DatasetConfig(folder_path=images, mask_path=masks, resolution=64)], progress=False)
    with open(os.path.join(masks, "img1.png"), "wb") as f:
        f.write(b"not a png")
    with pytest.raises(DataError, match=r"masks/img1.png: cannot read the image"):
        ImageDataset([DatasetConfig(folder_path=images, mask_path=masks, resolution=64)], progress=False)
    p = "datasets[0]"
    checks = {
        "mask_path: no such folder": dict(mask_path=str(tmp_path / "nowhere")),
        "alpha_mask: given together with mask_path": dict(mask_path=masks, alpha_mask=True),
        "mask_min_value: a weight in [0, 1)": dict(mask_path=masks, mask_min_value=1.0),
        "mask_min_value: 0.1 but the dataset has no masks": dict(mask_min_value=0.1),
        "invert_mask: true but the dataset has no masks": dict(invert_mask=True),
        "is_reg: expected true or false": dict(is_reg="yes"),
    }
    for msg, kw in checks.items():
        problems = validate_dataset_config(DatasetConfig(folder_path=images, **kw), p)
        assert any(x.startswith(f"{p}.{msg}") for x in problems), (msg, problems)
    assert validate_dataset_config(DatasetConfig(folder_path=images, mask_path=masks, mask_min_value=0.1,
                                                 invert_mask=True), p) == []
