"""Reading images: EXIF orientation, alpha compositing, formats, corrupt files, the folder walk, the probe index."""
import os
import time
import warnings

import numpy as np
import pytest
from make_images import png_bytes, write_caption, write_image
from PIL import Image, ImageFile

from flame_models.data import DataError, DatasetConfig, ImageDataset, image_array, list_images, load_image, probe_image
from flame_models.data import images as I


def halves(width, height, left, right):
    a = np.zeros((height, width, 3), np.uint8)
    a[:, : width // 2] = left
    a[:, width // 2:] = right
    return Image.fromarray(a)


@pytest.mark.parametrize("fmt,ext", [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")])
@pytest.mark.parametrize("orientation,expect", [
    (1, ("size", (64, 32), "left", "red")),
    (3, ("size", (64, 32), "left", "blue")),      # rotated 180°: red ends up on the right
    (6, ("size", (32, 64), "top", "red")),        # rotate 90° clockwise to display: the left edge goes to the top
    (8, ("size", (32, 64), "top", "blue")),       # rotate 90° counter-clockwise: the right edge goes to the top
])
def test_exif_orientation_is_applied(tmp_path, fmt, ext, orientation, expect):
    im = halves(64, 32, (255, 0, 0), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = str(tmp_path / f"o{orientation}.{ext}")
    im.save(path, fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}))
    out = load_image(path)
    assert out.mode == "RGB" and out.size == expect[1]
    a = np.asarray(out, dtype=float)
    first = a[: a.shape[0] // 4] if expect[2] == "top" else a[:, : a.shape[1] // 4]
    want = np.array([255, 0, 0] if expect[3] == "red" else [0, 0, 255])
    assert np.abs(first.reshape(-1, 3).mean(0) - want).max() < 12
    assert probe_image(path, str(tmp_path)).width == expect[1][0]


def test_alpha_is_composited_on_white(tmp_path):
    a = np.zeros((16, 16, 4), np.uint8)
    a[:, 8:] = (0, 200, 0, 255)                  # opaque green on the right
    a[:8, :8] = (255, 0, 0, 128)                 # half-transparent red, top left
    a[8:, :8] = (10, 20, 30, 0)                  # fully transparent (stored colour must not show), bottom left
    path = str(tmp_path / "rgba.png")
    Image.fromarray(a, "RGBA").save(path)
    out = np.asarray(load_image(path), dtype=int)
    assert (out[:, 8:] == (0, 200, 0)).all()
    assert (out[8:, :8] == 255).all()
    assert np.abs(out[:8, :8] - np.array([255, 127, 127])).max() <= 1
    la = Image.fromarray(np.dstack([np.full((4, 4), 40, np.uint8), np.zeros((4, 4), np.uint8)]), "LA")
    la.save(str(tmp_path / "la.png"))
    assert (np.asarray(load_image(str(tmp_path / "la.png"))) == 255).all()
    p = Image.new("P", (4, 4), 1)
    p.putpalette([0, 0, 0, 9, 9, 9] + [0] * 762)
    p.save(str(tmp_path / "pal.png"), transparency=1)
    assert (np.asarray(load_image(str(tmp_path / "pal.png"))) == 255).all()
    write_image(str(tmp_path / "grey.png"), 4, 4, mode="L")
    assert load_image(str(tmp_path / "grey.png")).mode == "RGB"


def test_image_array_range_and_layout():
    im = Image.fromarray(np.array([[[0, 255, 128]]], np.uint8))
    a = image_array(im)
    assert a.shape == (3, 1, 1) and a.dtype == np.float32
    np.testing.assert_allclose(a[:, 0, 0], [-1.0, 1.0, 128 / 127.5 - 1], atol=1e-7)


def test_corrupt_images_name_the_file(tmp_path):
    good = write_image(str(tmp_path / "good.png"), 32, 32)
    data = open(good, "rb").read()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "noise.jpg").write_bytes(os.urandom(300))
    (tmp_path / "empty.webp").write_bytes(b"")
    for name in ("truncated.png", "noise.jpg", "empty.webp"):
        with pytest.raises(DataError, match=rf"{name.replace('.', '[.]')}: cannot read the image"):
            probe_image(str(tmp_path / name), str(tmp_path))
    rec = probe_image(good, str(tmp_path))
    assert (rec.relpath, rec.width, rec.height, len(rec.sha256)) == ("good.png", 32, 32, 64)


def test_folder_walk(tmp_path):
    for name in ("b.PNG", "a.jpg", "sub/c.jpeg", "sub/deeper/d.webp", ".hidden.png", ".cache/e.png", "x.gif",
                 "notes.txt"):
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    got = [os.path.relpath(p, tmp_path) for p in list_images(str(tmp_path))]
    assert got == ["a.jpg", "b.PNG", "sub/c.jpeg", "sub/deeper/d.webp"]


def test_probe_index_skips_unchanged_images_and_rechecks_fresh_ones(tmp_path, monkeypatch):
    path = write_image(str(tmp_path / "a.png"), 20, 10)
    old = time.time() - 60
    os.utime(path, (old, old))
    index = I.ProbeIndex(str(tmp_path / "idx" / "images.json"))
    rec = probe_image(path, str(tmp_path))
    index.add(rec, time.time_ns())
    index.save()
    again = I.ProbeIndex(str(tmp_path / "idx" / "images.json"))
    assert again.lookup(path, str(tmp_path)) == rec
    write_image(path, 20, 10, seed=5)                   # rewritten: new mtime, so probed again
    assert again.lookup(path, str(tmp_path)) is None
    fresh = I.ProbeIndex(str(tmp_path / "idx" / "images.json"))
    fresh.add(probe_image(path, str(tmp_path)), time.time_ns())   # probed right after writing: racy, not trusted
    assert fresh.lookup(path, str(tmp_path)) is None
    (tmp_path / "idx" / "images.json").write_text("{not json")
    assert I.ProbeIndex(str(tmp_path / "idx" / "images.json")).entries == {}


# ----------------------------------------------------------------------------- bit depth
def test_16bit_grey_is_scaled_by_its_mode_not_its_values(tmp_path):
    """A 16-bit PNG whose values are all <= 255 is a very dark image, not an 8-bit one (it was 257x too bright)."""
    a = np.array([[0, 200, 255, 32896, 65535]], np.uint16)
    path = str(tmp_path / "dark16.png")
    Image.fromarray(a).save(path)
    assert Image.open(path).mode == "I;16"
    got = np.asarray(load_image(path))[0, :, 0]
    np.testing.assert_array_equal(got, [0, 1, 1, 128, 255])
    rows = b"".join(b"\0" + r.astype(">u2").tobytes() for r in np.full((2, 3), 255, np.uint16))   # by hand, too
    (tmp_path / "hand16.png").write_bytes(png_bytes(3, 2, 16, 0, rows))
    assert (np.asarray(load_image(str(tmp_path / "hand16.png"))) == 1).all()
    for mode in ("I;16B", "I"):     # Pillow's other 16-bit grey modes (I: how older Pillows opened 16-bit PNGs)
        im = Image.fromarray(np.array([[255, 65535]], np.int32)).convert(mode) if mode == "I" else \
            Image.frombytes("I;16B", (2, 1), np.array([255, 65535], ">u2").tobytes())
        np.testing.assert_array_equal(np.asarray(I._to_rgb(im))[0, :, 0], [1, 255])


# ----------------------------------------------------------------------------- decompression bombs
@pytest.fixture
def no_decoding(monkeypatch):
    """Decoding pixels fails the test: a refused image must be refused from its header alone."""
    def load(self):
        raise AssertionError(f"{self.size} image decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


@pytest.mark.parametrize("side", [9000, 12000, 20000])   # over the limit; over Pillow's warning; over its error
def test_a_png_declaring_a_huge_size_is_refused_before_decoding(tmp_path, no_decoding, side):
    path = tmp_path / f"bomb{side}.png"
    path.write_bytes(png_bytes(side, side, 1, 0))       # 1-bit grey: a few hundred bytes
    assert path.stat().st_size < 1000
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # Pillow's DecompressionBombWarning must not escape either
        with pytest.raises(DataError) as e:
            probe_image(str(path), str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: the image is ") and f"{side * side} pixels" in msg, msg
    assert f"max_pixels {8192 * 8192}" in msg and "refused before decoding" in msg, msg
    if side < 20000:
        assert f"{side}x{side}" in msg


def test_the_pixel_limit_is_a_dataset_setting(tmp_path):
    root = tmp_path / "imgs"
    rows = b"".join(b"\0" + b"\xff" * 38 for _ in range(300))  # a valid 300 x 300 1-bit PNG: 90000 pixels
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "big.png").write_bytes(png_bytes(300, 300, 1, 0, rows))
    write_caption(str(root / "sub" / "big.png"), "white")
    cfg = dict(folder_path=str(root), resolution=256, cache_latents_to_disk=True)
    old = time.time() - 60
    os.utime(root / "sub" / "big.png", (old, old))
    assert len(ImageDataset([DatasetConfig(**cfg)], progress=False).records) == 1   # and its probe is indexed
    for cached in (False, True):   # probed again; and the probe of the first run, from its index
        with pytest.raises(DataError, match=r"big\.png: the image is 300x300 = 90000 pixels .* max_pixels 50000"):
            ImageDataset([DatasetConfig(**dict(cfg, cache_latents_to_disk=cached), max_pixels=50000)],
                         progress=False)
    with pytest.raises(DataError, match=r"datasets\[0\]\.max_pixels: a positive integer"):
        ImageDataset([DatasetConfig(**cfg, max_pixels=0)], progress=False)
    with pytest.raises(DataError, match="90000 pixels"):
        load_image(str(root / "sub" / "big.png"), max_pixels=89999)
