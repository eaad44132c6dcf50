"""Reading images: the folder walk, decoding (EXIF orientation applied, alpha composited onto white, RGB), and a
probe that checks each image decodes and records its size and content hash before any model is loaded.

Transparent pixels become white (255, 255, 255): the colour of a page behind a cut-out, and what most viewers show;
PIL's plain convert("RGB") would instead expose whatever colour the transparent pixels happen to store.

Images are untrusted: a small PNG can declare 12000 x 12000 pixels (gigabytes once decoded), so the size in the
header is checked against `max_pixels` (default config.MAX_PIXELS, 64 megapixels; the dataset's `max_pixels`) before
anything is decoded; Pillow's own decompression-bomb warning and error become that same DataError. 16-bit greyscale
(PNG modes I;16, I;16B, I) is scaled by its bit depth (÷ 65535), never guessed from the values.
"""
import hashlib
import io as _io
import json
import os
import re
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from flame_core.io import atomic_write

from .config import IMAGE_EXTENSIONS, MAX_PIXELS
from .errors import DataError
from .walk import walk_files

# warnings.catch_warnings swaps process-wide state: images opened by several threads (the latent cache's) take turns
_PILLOW_WARNINGS = threading.Lock()

BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class ImageRecord:
    path: str            # absolute path
    relpath: str         # path inside its dataset folder ('/'-separated)
    sha256: str          # of the file's bytes
    width: int           # after EXIF orientation
    height: int


def list_images(folder, warn=None):
    """Sorted image files under `folder` (recursive; names and folders starting with '.' skipped; symbolic links
    followed only inside the folder, others skipped with warn(message): walk.py)."""
    return [p for p in walk_files(folder, warn) if p.lower().endswith(IMAGE_EXTENSIONS)]


def _to_rgb(im):
    """An RGB PIL image: EXIF orientation applied, alpha (RGBA, LA, palette transparency) composited on white."""
    from PIL import Image, ImageOps
    im = ImageOps.exif_transpose(im)
    if im.mode == "P":  # a palette may carry transparency; make it explicit before compositing
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode in ("RGB", "L") and "transparency" in im.info):
        rgba = im.convert("RGBA")
        out = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        out.alpha_composite(rgba)
        return out.convert("RGB")
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grey (PNG's; Pillow once opened it as I): by bit depth
        a = np.clip(np.asarray(im, dtype=np.float64), 0, 65535)
        return Image.fromarray(np.round(a * (255.0 / 65535.0)).astype(np.uint8), "L").convert("RGB")
    return im.convert("RGB")


def _too_large(name, pixels, max_pixels, size=None):
    dims = f"{size[0]}x{size[1]} = " if size else ""
    return DataError(f"{name}: the image is {dims}{pixels} pixels ({pixels / 1e6:.1f} megapixels), more than "
                     f"max_pixels {max_pixels} ({max_pixels / 1e6:.1f} megapixels); refused before decoding (raise "
                     f"the dataset's max_pixels to use it)")


def check_pixels(name, width, height, max_pixels=MAX_PIXELS):
    """DataError naming `name` and its size when width x height is over `max_pixels`."""
    if width * height > max_pixels:
        raise _too_large(name, width * height, max_pixels, (width, height))


def open_image(data, name, max_pixels=MAX_PIXELS):
    """A PIL image of the bytes of an image file with only its header read, its size checked against max_pixels
    (Pillow's decompression-bomb warning and error turned into the same DataError); nothing is decoded yet."""
    from PIL import Image
    with _PILLOW_WARNINGS, warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)    # the check below decides
        try:
            im = Image.open(_io.BytesIO(data))
        except Image.DecompressionBombError as ex:   # over twice Pillow's MAX_IMAGE_PIXELS: the size is in the text
            found = re.search(r"\((\d+) pixels\)", str(ex))
            if found is None:
                raise DataError(f"{name}: the image is too large to open ({ex}); refused before decoding") from None
            raise _too_large(name, int(found.group(1)), max_pixels) from None
    check_pixels(name, im.width, im.height, max_pixels)
    return im


def decode_image(data, name, max_pixels=MAX_PIXELS):
    """An RGB PIL image from the bytes of an image file; DataError naming `name` when it does not decode or is
    larger than `max_pixels` (checked from the header, before decoding)."""
    from PIL import Image
    try:
        im = open_image(data, name, max_pixels)
        im.load()
        return _to_rgb(im)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as ex:
        if isinstance(ex, DataError):
            raise
        raise DataError(f"{name}: cannot read the image ({type(ex).__name__}: {ex})") from None


def is_image(obj):
    """Whether `obj` is a PIL image (an image given in memory rather than a file)."""
    from PIL import Image
    return isinstance(obj, Image.Image)


def as_rgb(im, name="the image", max_pixels=MAX_PIXELS):
    """An RGB copy of a PIL image given in memory, as load_image makes of a file: its size checked against
    max_pixels (DataError naming `name`), EXIF orientation applied, alpha composited on white."""
    check_pixels(name, im.width, im.height, max_pixels)
    return _to_rgb(im)


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as ex:
        raise DataError(f"{path}: cannot read the file ({ex.strerror or ex})") from None


def load_image(path, max_pixels=MAX_PIXELS):
    """An RGB PIL image of the file at `path` (EXIF orientation applied, alpha composited on white)."""
    return decode_image(read_bytes(path), path, max_pixels)


def probe_image(path, folder, max_pixels=MAX_PIXELS):
    """An ImageRecord for `path`: the whole file is decoded (a corrupt or truncated image fails here, naming it)."""
    data = read_bytes(path)
    im = decode_image(data, path, max_pixels)
    return ImageRecord(os.path.abspath(path), os.path.relpath(path, folder).replace(os.sep, "/"),
                       hashlib.sha256(data).hexdigest(), im.width, im.height)


def image_array(im):
    """(3, H, W) float32 in [-1, 1] from an RGB PIL image (what a VAE encoder takes)."""
    a = np.asarray(im, dtype=np.float32)                  # (H, W, 3) in [0, 255]
    return np.ascontiguousarray(a.transpose(2, 0, 1)) / 127.5 - 1.0


class ProbeIndex:
    """Probes of earlier runs, so an unchanged image is not decoded and hashed again at every start: a JSON file
    {absolute path: [size, mtime_ns, probed_at_ns, sha256, width, height]}. An entry is used only when the file's
    size and mtime still match and the file was last modified at least RACY_NS before it was probed (a file
    rewritten within the clock's granularity of its probe is probed again, as git treats "racily clean" entries)."""

    VERSION = 1
    RACY_NS = 2_000_000_000

    def __init__(self, path):
        self.path, self.entries, self.dirty = path, {}, False
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("version") == self.VERSION and isinstance(data.get("images"), dict):
                self.entries = data["images"]
        except (OSError, ValueError, AttributeError):
            pass  # no index yet, or an unreadable one: probe everything again

    def lookup(self, path, folder):
        e = self.entries.get(os.path.abspath(path))
        try:
            st = os.stat(path)
        except OSError:
            return None
        if (not isinstance(e, list) or len(e) != 6 or e[0] != st.st_size or e[1] != st.st_mtime_ns
                or st.st_mtime_ns > e[2] - self.RACY_NS):
            return None
        return ImageRecord(os.path.abspath(path), os.path.relpath(path, folder).replace(os.sep, "/"), e[3], e[4], e[5])

    def add(self, record, probed_at_ns):
        try:
            st = os.stat(record.path)
        except OSError:
            return
        self.entries[record.path] = [st.st_size, st.st_mtime_ns, probed_at_ns, record.sha256, record.width,
                                     record.height]
        self.dirty = True

    def save(self):
        if not self.dirty:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with atomic_write(self.path, "w", encoding="utf-8") as f:
            json.dump({"version": self.VERSION, "images": self.entries}, f)
        self.dirty = False
