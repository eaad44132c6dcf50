"""The Flux VAE's part in the Flux-derived families: loading it, and model-space latents <-> images.

Latents in "model space" are what the transformer sees: VAE latents z as (z - 0.1159) * 0.3611, unpacked to
(B, 16, H/8, W/8)."""
import os

import flame_core as flame

from ..vae import decode_model_latents, encode_model_latents, load_family_vae
from ..vae.latent_format import LatentFormat
from .components import FluxFiles, FluxFilesError
from .sampling import LATENT_CHANNELS, LATENT_SCALE, LATENT_SHIFT

LATENT_FORMAT = LatentFormat(scaling_factor=LATENT_SCALE, shift_factor=LATENT_SHIFT)


def load_vae_for_flux(files, *, dtype=flame.bfloat16, device=None):
    """The Flux VAE of `files` (FluxFiles, or a path to the VAE itself), frozen, in `dtype` on `device`."""
    path = files.vae if isinstance(files, FluxFiles) else os.fspath(files)
    return load_family_vae(path, LATENT_CHANNELS, family="Flux", others="an SD / SDXL", error=FluxFilesError,
                           dtype=dtype, device=device)


def decode_latents(vae, latents):
    """Model-space latents (B, 16, H/8, W/8) -> images (B, 3, H, W) in [-1, 1] (nominally; not clamped), in the
    VAE's dtype, on its device: z = latents / 0.3611 + 0.1159, then the decoder."""
    return decode_model_latents(vae, latents, LATENT_FORMAT, hint=" (unpack packed tokens first: flux.unpack)")


def encode_images(vae, images):
    """Images (B, 3, H, W) in [-1, 1] -> model-space latents (B, 16, H/8, W/8) float32: the posterior mean z, then
    (z - 0.1159) * 0.3611."""
    return encode_model_latents(vae, images, LATENT_FORMAT)
