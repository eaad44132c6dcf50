"""Images and captions drawn with Pillow into a test's tmp_path (no binary fixtures)."""
import os

import numpy as np
from PIL import Image


def write_image(path, width, height, seed=0, mode="RGB", fmt=None, **save_kw):
    """A random-noise image of the given size (so re-encodings differ in bytes); returns the path."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    im = Image.fromarray(a[..., 0] if channels == 1 else a, mode)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    im.save(path, format=fmt, **save_kw)
    return path


def write_caption(image_path, text, ext=".txt", encoding="utf-8"):
    path = os.path.splitext(image_path)[0] + ext
    with open(path, "wb") as f:
        f.write(text.encode(encoding) if isinstance(text, str) else text)
    return path


def png_bytes(width, height, bit_depth, colour_type, rows=None):
    """A PNG written by hand: any declared size (`rows`: the filtered scanlines, None for a few bytes of IDAT that
    decode to nothing useful), so a test can declare 12000 x 12000 pixels in a few hundred bytes."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    idat = zlib.compress(rows if rows is not None else b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
