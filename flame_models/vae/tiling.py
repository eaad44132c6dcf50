"""Tiled encode and decode with overlapping tiles blended linearly at the seams (diffusers' AutoencoderKL semantics).

Tiles of `tile` pixels (tile / f latent pixels) start every tile * (1 - overlap) pixels; tiles are processed in
raster order and each one is blended, in place of its first rows / columns, with the already blended tile above
(blend_v) and then the one to its left (blend_h) over `blend` output pixels; each tile then contributes its top-left
(tile_out - blend) square (the last row / column whatever remains). Only the previous row of tiles is kept, so the
memory is one tile's activations plus a row of outputs.
"""
import numpy as np

import flame_core as flame


def _ramp(n, dim, like):
    """(1 - y/n, y/n) for y < n as float tensors shaped to broadcast along `dim` of a 4-D tensor like `like`."""
    y = np.arange(n, dtype=np.float64) / n
    shape = [1, 1, 1, 1]
    shape[dim] = n
    cd = flame.float64 if like.dtype == flame.float64 else flame.float32
    up = flame.tensor(y.reshape(shape), dtype=cd, device=like.device)
    down = flame.tensor((1.0 - y).reshape(shape), dtype=cd, device=like.device)
    return down, up


def _blend(a, b, extent, dim):
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    down, up = _ramp(extent, dim, b)
    a_end = a.narrow(dim, a.shape[dim] - extent, extent)
    b_start = b.narrow(dim, 0, extent)
    mixed = (a_end.to(down.dtype) * down + b_start.to(up.dtype) * up).to(b.dtype)
    return flame.cat([mixed, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def blend_v(a, b, blend_extent):
    """b with its first rows faded in from the last rows of a (the tile above)."""
    return _blend(a, b, blend_extent, 2)


def blend_h(a, b, blend_extent):
    """b with its first columns faded in from the last columns of a (the tile to the left)."""
    return _blend(a, b, blend_extent, 3)


def _tiled(x, tile_in, tile_out, overlap_factor, run):
    overlap = int(tile_in * (1 - overlap_factor))
    blend = int(tile_out * overlap_factor)
    keep = tile_out - blend
    if overlap < 1:
        raise ValueError(f"tiling: a tile of {tile_in} with overlap factor {overlap_factor} does not advance")
    H, W = x.shape[-2:]
    rows, above = [], None
    for i in range(0, H, overlap):
        row, kept = [], []
        for j in range(0, W, overlap):
            t = run(x[:, :, i:i + tile_in, j:j + tile_in].contiguous())
            if above is not None:
                t = blend_v(above[len(row)], t, blend)
            if row:
                t = blend_h(row[-1], t, blend)
            row.append(t)
            kept.append(t[:, :, :keep, :keep])
        rows.append(flame.cat(kept, dim=3))
        del kept
        above = row
    return flame.cat(rows, dim=2)


def tiled_encode(vae, x):
    """The encoder's moments of x, computed tile by tile (diffusers' AutoencoderKL._tiled_encode)."""
    return _tiled(x, vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor, vae._encode_tile)


def tiled_decode(vae, z):
    """The decoder's images of z, computed tile by tile (diffusers' AutoencoderKL.tiled_decode)."""
    return _tiled(z, vae.tile_latent_min_size, vae.tile_sample_min_size, vae.tile_overlap_factor, vae._decode_tile)
