"""The VAE stage of Qwen-Image's trainer family (its `pipeline` module): images in [-1, 1] to the normalised latent
space the transformer trains on, z_n = (z - mean_c) / std_c of the posterior mean, and back for previews."""
import flame_core as flame

from .latents import LATENT_FORMAT


def encode_images(vae, images):
    """(B, 3, H, W) in [-1, 1] -> model-space latents (B, 16, H/8, W/8) float32."""
    with flame.no_grad():
        z = vae.encode(images.to(vae.device).to(vae.dtype))
        return LATENT_FORMAT.to_model(z.float())


def decode_latents(vae, latents):
    """Model-space latents (B, 16, h, w) -> images (B, 3, 8h, 8w), nominally in [-1, 1]."""
    with flame.no_grad():
        z = LATENT_FORMAT.from_model(latents.to(vae.device).float())
        return vae.decode(z.to(vae.dtype))
