"""The UNet's sinusoidal embeddings and SDXL's conditioning vector y.

    y = [pooled CLIP-G embedding ‖ ts(orig_h) ‖ ts(orig_w) ‖ ts(crop_top) ‖ ts(crop_left) ‖ ts(target_h) ‖ ts(target_w)]

with ts the cos-first embedding of SAI's `timestep_embedding` (diffusers: flip_sin_to_cos=True, freq_shift=0) at
size_embed_dim (256) channels each: 1280 + 6 * 256 = 2816 = adm_in_channels.
"""
import math

import numpy as np

import flame_core as flame


def timestep_embedding(timesteps, dim, max_period=10_000):
    """(B,) timesteps (integer or fractional) -> (B, dim) float32 [cos(t f) | sin(t f)], f_i = max_period^(-i/half)
    (float64 for float64 input)."""
    if timesteps.ndim != 1:
        raise ValueError(f"timestep_embedding expects a (B,) tensor, got shape {tuple(timesteps.shape)}")
    cd = flame.float64 if timesteps.dtype == flame.float64 else flame.float32
    half = dim // 2
    freqs = (-math.log(max_period) * flame.arange(half, dtype=cd, device=timesteps.device) / half).exp()
    args = timesteps.to(cd)[:, None] * freqs[None]                          # (B, half)
    emb = flame.cat([args.cos(), args.sin()], dim=-1)
    if dim % 2:
        emb = flame.cat([emb, flame.zeros_like(emb[:, :1])], dim=-1)
    return emb


def _pairs(value, batch, what):
    """(B, 2) float64 array from one (a, b) pair, B pairs, or a (B, 2) tensor/array."""
    if isinstance(value, flame.Tensor):
        value = value.numpy()
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape == (2,):
        arr = np.broadcast_to(arr, (batch, 2))
    if arr.shape != (batch, 2):
        raise ValueError(f"make_y: {what} must be one (a, b) pair or {batch} pairs (one per sample), got shape "
                         f"{arr.shape}")
    return arr


def size_embeddings(original_size, crop_coords, target_size, batch_size, size_embed_dim=256, device=None):
    """(B, 6 * size_embed_dim) float32: the embeddings of (orig_h, orig_w, crop_top, crop_left, target_h, target_w).
    Each argument is one (a, b) pair for the whole batch or one pair per sample (a list or a (B, 2) array)."""
    ids = np.concatenate([_pairs(original_size, batch_size, "original_size"),
                          _pairs(crop_coords, batch_size, "crop_coords"),
                          _pairs(target_size, batch_size, "target_size")], axis=1)    # (B, 6)
    t = flame.tensor(ids.reshape(-1).astype(np.float32), device=device)
    return timestep_embedding(t, size_embed_dim).reshape(batch_size, 6 * size_embed_dim)


def make_y(pooled, original_size, crop_coords=(0, 0), target_size=None, size_embed_dim=256):
    """SDXL's y (B, pooled + 6 * size_embed_dim) from the pooled text embedding (B, P) and the size conditioning:
    original_size = the source image's (height, width) before any resize, crop_coords = the (top, left) pixel of the
    crop taken from the resized image, target_size = the (height, width) generated (default: original_size). Heights
    and widths in pixels, as the dataset reports them. The result has pooled's dtype and device."""
    if not isinstance(pooled, flame.Tensor) or pooled.ndim != 2:
        raise ValueError(f"make_y: pooled must be a (B, P) tensor, got "
                         f"{tuple(pooled.shape) if isinstance(pooled, flame.Tensor) else type(pooled).__name__}")
    B = pooled.shape[0]
    if target_size is None:
        target_size = original_size
    sizes = size_embeddings(original_size, crop_coords, target_size, B, size_embed_dim, device=pooled.device)
    return flame.cat([pooled, sizes.to(pooled.dtype)], dim=1)
