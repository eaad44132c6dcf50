"""Loss masks (ai-toolkit's datasets' `mask_path`, `alpha_mask`, `invert_mask`, `mask_min_value`): a weight per
latent pixel for the loss of each sample, placed exactly as its image is, and cached beside the latents.

    mask_path: masks/      masks/a.png is the mask of images/a.png (the same relative name, any image extension)
    alpha_mask: true       the image's own alpha channel is its mask (an image without alpha: all 1)

A mask is read as 8-bit grayscale (colour masks through Pillow's "L" conversion, as ai-toolkit reads them; 16-bit
ones scaled by their bit depth, as images are; EXIF orientation applied) and goes through its image's placement in
the image's own pixel format: resized to the image's cover size with the same LANCZOS filter (the mask is stretched
from its own size, which must have the image's aspect ratio), cropped at the image's crop and flipped with it -- a
mask holding an image's gray levels comes out as that image's pixels, exactly. Then m = value / 255 in [0, 1],
`invert_mask` turns m into 1 - m, and each
latent pixel takes the mean of the f x f pixels it encodes (f = the VAE's 8: PyTorch's interpolate(mode="area"), as
kohya resizes its masks; buckets are multiples of 32 px, so the blocks are whole), and the weights are
mask_min_value + (1 - mask_min_value) * m. The loss (training/loss_weights.py) multiplies each latent element's
squared error by its pixel's weight before the mean, as kohya and ai-toolkit do (no renormalisation: a mostly black
mask lowers the loss's scale).

An image of a `mask_path` dataset without a mask file trains with weight 1 everywhere (ai-toolkit's rule); the
dataset's warnings say how many and which. Masks are cached in <cache root>/masks (each dataset's
.flame_cache/masks with cache_latents_to_disk, else host memory), keyed by the mask file's SHA-256 and everything
that decides the weights (placement, flips, invert, min value, f, filter): an edited mask gets a new entry.
"""
import json
import os
from dataclasses import dataclass

import numpy as np

from . import images as I
from .buckets import Bucket
from .cache import _bar, _digest, _finite, _Store
from .errors import DataError

MASK_VERSION = 1            # bump when the weights a MaskSpec produces change
ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")


@dataclass(frozen=True)
class MaskSpec:
    """One mask to place and cache: its file (the image itself for alpha masks), the image's placement and flips,
    and where to keep it (`folder` None: host memory)."""
    path: str
    sha256: str
    alpha: bool            # the file's alpha channel is the mask (alpha_mask)
    invert: bool
    min_value: float
    bucket: Bucket
    resized: tuple         # (width, height): the image's cover size
    crop: tuple            # (top, left) of the image's crop
    flip_x: bool
    flip_y: bool
    factor: int            # pixels per latent pixel (the VAE's scale factor)
    folder: str = None
    max_pixels: int = I.MAX_PIXELS

    def params(self):
        """Everything besides the file's bytes that decides the weights (part of the cache key)."""
        return {"v": MASK_VERSION, "alpha": self.alpha, "invert": self.invert, "min": self.min_value,
                "bucket": list(self.bucket), "resized": list(self.resized), "crop": list(self.crop),
                "flip_x": self.flip_x, "flip_y": self.flip_y, "factor": self.factor, "filter": "lanczos"}

    def pixels(self):
        """(bucket height, bucket width) float32 in [0, 1]: the mask as its image's pixels are placed (inverted
        when asked; before mask_min_value)."""
        from PIL import Image
        m = read_mask(self.path, self.alpha, self.max_pixels)
        im = Image.fromarray(m, "L").resize(self.resized, Image.Resampling.LANCZOS)     # as LatentSpec.pixels
        top, left = self.crop
        im = im.crop((left, top, left + self.bucket.width, top + self.bucket.height))
        if self.flip_x:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.flip_y:
            im = im.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        m = np.asarray(im, dtype=np.float32) / 255.0
        return 1.0 - m if self.invert else m

    def weights(self):
        """(1, h, w) float32 loss weights on the latent grid (h, w = the bucket's sides / factor)."""
        m = self.pixels().astype(np.float64)
        f = self.factor
        h, w = m.shape[0] // f, m.shape[1] // f
        area = m[:h * f, :w * f].reshape(h, f, w, f).mean(axis=(1, 3))           # interpolate(mode="area")
        return (self.min_value + (1.0 - self.min_value) * area).astype(np.float32)[None]


def read_mask(path, alpha=False, max_pixels=I.MAX_PIXELS):
    """(H, W) uint8 of a mask file (EXIF orientation applied): its gray levels, or with `alpha` its alpha channel
    (all 255 when it has none)."""
    from PIL import Image, ImageOps
    try:
        im = I.open_image(I.read_bytes(path), path, max_pixels)
        im.load()
        im = ImageOps.exif_transpose(im)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as ex:
        if isinstance(ex, DataError):
            raise
        raise DataError(f"{path}: cannot read the mask ({type(ex).__name__}: {ex})") from None
    if alpha:
        if im.mode == "P" or (im.mode in ("RGB", "L") and "transparency" in im.info):
            im = im.convert("RGBA")
        if im.mode not in ALPHA_MODES:
            return np.full((im.height, im.width), 255, np.uint8)
        return np.asarray(im.getchannel("A"), dtype=np.uint8)
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):     # 16-bit grey: by bit depth, as images.py reads it
        a = np.clip(np.asarray(im, dtype=np.float64), 0, 65535)
        return np.round(a * (255.0 / 65535.0)).astype(np.uint8)
    if im.mode == "F":                                   # a float mask (TIFF): values in [0, 1]
        return np.round(np.clip(np.asarray(im, dtype=np.float64), 0.0, 1.0) * 255.0).astype(np.uint8)
    return np.asarray(im.convert("L"), dtype=np.uint8)


def find_mask(rec, mask_path, max_pixels):
    """The ImageRecord of the mask of image record `rec` in `mask_path` (the same relative name, any image
    extension), or None when there is none; DataError when it does not decode, there are several, or its aspect
    ratio is not the image's."""
    stem = os.path.splitext(rec.relpath)[0]
    found = [os.path.join(mask_path, stem + ext) for ext in I.IMAGE_EXTENSIONS + tuple(
        e.upper() for e in I.IMAGE_EXTENSIONS)]
    found = [f for f in found if os.path.isfile(f)]
    if not found:
        return None
    if len(found) > 1 and len({os.path.normcase(os.path.realpath(f)) for f in found}) > 1:
        raise DataError(f"{rec.path}: several masks in {mask_path}: {', '.join(os.path.basename(f) for f in found)}; "
                        f"keep one")
    mask = I.probe_image(found[0], mask_path, max_pixels)
    # stretched to its image's size, the mask may be off by at most a pixel (a mask saved at a smaller scale)
    if abs(mask.height * rec.width / mask.width - rec.height) > 1:
        raise DataError(f"{mask.path}: a {mask.width}x{mask.height} mask for the {rec.width}x{rec.height} image "
                        f"{rec.path}: another aspect ratio (a mask is stretched to its image: give it the image's "
                        f"size)")
    return mask


class MaskCache:
    """Latent-grid loss weights per MaskSpec: files in each spec's `folder`, or host memory. No model is needed:
    `fill` places every mask not cached yet."""

    def __init__(self, factor=8):
        self.factor = int(factor)  # pixels per latent pixel: the family's vae_scale_factor
        self._stores = {}
        self.placed = 0           # entries made by this object

    def _store(self, folder):
        if folder not in self._stores:
            self._stores[folder] = _Store(folder)
        return self._stores[folder]

    def key(self, spec):
        return _digest({"mask": spec.sha256, "params": spec.params()})

    def missing(self, specs):
        """The specs (one per distinct key) that have no cached entry."""
        seen, out = set(), []
        for s in specs:
            k = self.key(s)
            if k not in seen:
                seen.add(k)
                if not self._store(s.folder).has(k):
                    out.append(s)
        return out

    def fill(self, specs, progress=True):
        """Place and store every spec not cached yet; returns how many."""
        todo = self.missing(specs)
        for folder in {s.folder for s in todo}:
            self._store(folder).check_writable()
        bar = _bar(len(todo), "Caching masks", progress and bool(todo))
        try:
            for s in todo:
                w = s.weights()
                _finite({"mask": w}, f"mask {s.path}")
                self._store(s.folder).write(self.key(s), {"mask": w}, {
                    "format": "flame-mask-cache/1", "mask": s.path, "params": json.dumps(s.params(), sort_keys=True)})
                self.placed += 1
                bar.update(1)
        finally:
            bar.close()
        return len(todo)

    def load(self, spec):
        """The cached weights (1, h, w) of `spec`."""
        return self._store(spec.folder).read(self.key(spec), f"mask {spec.path} ({spec.bucket})")["mask"]
