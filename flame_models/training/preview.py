"""Preview grids: decoded images (rows = prompts, columns = steps, labelled), or -- for runs without a VAE
(precomputed latents, synthetic data) -- latent projections, labelled as such.

A latent projection shows latents as RGB WITHOUT decoding: each latent pixel (C channels, 1/8 of the image size)
is mapped to RGB by one fixed linear projection (a seeded, orthonormal C -> 3 matrix: the same colours for the same
latents in every run), stretched to the 1st-99th percentile range of the grid and upscaled x8 with nearest-neighbour.
It shows layout and structure, not the image's colours.
"""
import textwrap

import numpy as np

from flame_core.io import atomic_write

_PROJ = {}
PROJECTION_TITLE = ("latent projection (no VAE in this run): a fixed mix of the latent channels, not the decoded "
                    "image")


def projection(channels=16):
    if channels not in _PROJ:
        q, _ = np.linalg.qr(np.random.default_rng(channels).standard_normal((channels, 3)))
        _PROJ[channels] = q.astype(np.float32)            # (C, 3), orthonormal columns
    return _PROJ[channels]


def latents_to_rgb(latents):
    """(C, h, w) latents -> (h, w, 3) float RGB (not yet scaled)."""
    z = np.asarray(latents, dtype=np.float32)
    if z.ndim != 3 or z.shape[0] < 3:
        raise ValueError(f"a latent preview expects (C >= 3, h, w) latents, got shape {z.shape}")
    return np.einsum("chw,cr->hwr", z, projection(z.shape[0]))


def projection_images(rows, scale=8):
    """Rows of (C, h, w) latents -> rows of (h*scale, w*scale, 3) uint8 images, one colour range for all."""
    rgb = [[latents_to_rgb(z) for z in row] for row in rows]
    allv = np.concatenate([x.reshape(-1) for row in rgb for x in row])
    lo, hi = np.percentile(allv, 1), np.percentile(allv, 99)
    hi = hi if hi > lo else lo + 1.0
    out = []
    for row in rgb:
        out.append([np.repeat(np.repeat((np.clip((x - lo) / (hi - lo), 0, 1) * 255).astype(np.uint8), scale, 0),
                              scale, 1) for x in row])
    return out


def to_uint8(images):
    """(B, 3, H, W) float images in [-1, 1] -> list of (H, W, 3) uint8 (diffusers' postprocess rounding)."""
    a = np.clip(np.asarray(images, dtype=np.float32) / 2 + 0.5, 0, 1)
    return list((a.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8))


def _font(size):
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def save_image(img, path):
    """A PIL image as a PNG, written atomically (flame_core.io.atomic_write). Returns `path`."""
    with atomic_write(path) as f:
        img.save(f, format="PNG")
    return path


def save_image_grid(rows, path, col_labels=None, row_labels=None, title=None, gap=4):
    """Write a labelled PNG grid (atomically). rows: list of rows, each a list of (H, W, 3) uint8 arrays (of any
    sizes: a row is as tall as its tallest image, a column as wide as the widest image; shorter rows leave blanks);
    col_labels above the columns, row_labels (wrapped) left of the rows, an optional title line on top."""
    from PIL import Image, ImageDraw

    heights = [max(np.shape(img)[0] for img in r) if r else 0 for r in rows]
    w = max(np.shape(img)[1] for r in rows for img in r)
    n_cols = max(len(r) for r in rows)
    font = _font(13)
    line_h = 16
    label_w = 0
    wrapped = []
    if row_labels:
        chars = max(14, min(28, w // 7))
        wrapped = [textwrap.wrap(str(t), chars)[:max(1, heights[i] // line_h)] or [""]
                   for i, t in enumerate(row_labels)]
        label_w = 7 * max(len(x) for lines in wrapped for x in lines) + 2 * gap
    top = (line_h + gap if title else 0) + (line_h + gap if col_labels else 0)
    width = label_w + n_cols * (w + gap) + gap
    if title:
        width = max(width, 7 * len(title) + 2 * gap)
    canvas = Image.new("RGB", (width, top + sum(x + gap for x in heights) + gap), (255, 255, 255))
    d = ImageDraw.Draw(canvas)
    y0 = gap
    if title:
        d.text((gap, y0), title, fill=(0, 0, 0), font=font)
        y0 += line_h + gap
    if col_labels:
        for j, text in enumerate(col_labels):
            d.text((label_w + gap + j * (w + gap), y0), str(text), fill=(0, 0, 0), font=font)
    y = top + gap
    for i, row in enumerate(rows):
        if wrapped:
            for k, line in enumerate(wrapped[i]):
                d.text((gap, y + k * line_h), line, fill=(0, 0, 0), font=font)
        for j, img in enumerate(row):
            canvas.paste(Image.fromarray(np.asarray(img, dtype=np.uint8)), (label_w + gap + j * (w + gap), y))
        y += heights[i] + gap
    return save_image(canvas, path)


def save_grid(rows, path, labels=None, scale=8, gap=4, row_labels=None):
    """A latent-projection grid: `rows` of (C, h, w) latents; titled as a projection."""
    return save_image_grid(projection_images(rows, scale), path, col_labels=labels, row_labels=row_labels,
                           title=PROJECTION_TITLE, gap=gap)
