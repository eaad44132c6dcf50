"""Reading images: EXIF orientation, alpha compositing, formats, corrupt files, the folder walk, the probe index."""
import os
import time

import numpy as np
import pytest
from make_images import write_image
from PIL import Image

from flame_models.data import DataError, image_array, list_images, load_image, probe_image
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
