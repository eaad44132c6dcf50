"""Fixtures of the image-data tests."""
import pytest
from make_images import write_caption, write_image


@pytest.fixture
def folder(tmp_path):
    """A folder of five captioned PNGs of several aspect ratios (each at least 256 px on its short side)."""
    root = tmp_path / "images"
    sizes = [(320, 256), (256, 320), (256, 256), (512, 256), (384, 384)]
    for i, (w, h) in enumerate(sizes):
        p = write_image(str(root / f"img{i}.png"), w, h, seed=i)
        write_caption(p, f"a photo of thing{i}, red, blue, green")
    return str(root)
