"""Latent previews: latents shown as RGB WITHOUT a VAE decode (decoded previews come with flame_models.vae).

Each latent pixel (C channels, 1/8 of the image size) is mapped to RGB by one fixed linear projection (a seeded,
orthonormal C -> 3 matrix: the same colours for the same latents in every run), then stretched to the 1st-99th
percentile range of the grid and upscaled x8 with nearest-neighbour. It shows layout and structure, not the final
image's colours.
"""
import numpy as np

_PROJ = {}


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


def save_grid(rows, path, labels=None, scale=8, gap=4):
    """Write a PNG grid (atomically): `rows` is a list of rows, each a list of (C, h, w) latents (one size)."""
    from PIL import Image, ImageDraw

    from .files import save_image
    rgb = [[latents_to_rgb(z) for z in row] for row in rows]
    allv = np.concatenate([x.reshape(-1) for row in rgb for x in row])
    lo, hi = np.percentile(allv, 1), np.percentile(allv, 99)
    hi = hi if hi > lo else lo + 1.0
    h, w = rgb[0][0].shape[:2]
    H, W = h * scale, w * scale
    n_rows, n_cols = len(rgb), max(len(r) for r in rgb)
    top = 14 if labels else 0
    canvas = Image.new("RGB", (n_cols * (W + gap) + gap, top + n_rows * (H + gap) + gap), (255, 255, 255))
    for i, row in enumerate(rgb):
        for j, x in enumerate(row):
            a = np.clip((x - lo) / (hi - lo), 0, 1)
            tile = Image.fromarray((a * 255).astype(np.uint8)).resize((W, H), Image.NEAREST)
            canvas.paste(tile, (gap + j * (W + gap), top + gap + i * (H + gap)))
    if labels:
        d = ImageDraw.Draw(canvas)
        for j, text in enumerate(labels):
            d.text((gap + j * (W + gap), 1), str(text), fill=(0, 0, 0))
    return save_image(canvas, path)
