"""A diffusion family's use of the VAE: loading it with the family's latent channel count checked, and converting
between the family's model-space latents (its LatentFormat) and images."""
import flame_core as flame

from .loading import load_vae


def load_family_vae(path, channels, *, family, others, error, dtype=None, device=None, config=None):
    """load_vae(path, dtype, device, config=config), refused with `error` naming the file when its latents do not
    have the family's `channels` (`others`: the families the VAE may belong to instead, for the message)."""
    vae = load_vae(path, dtype=dtype, device=device, config=config)
    if vae.config.z_channels != channels:
        raise error(f"vae: {path} has {vae.config.z_channels} latent channels; {family}'s VAE has {channels} (is "
                    f"this {others} VAE?)")
    return vae


def check_latents(vae, latents, hint=""):
    """ValueError unless `latents` is (B, z_channels, h, w) for this VAE (`hint` ends the message)."""
    if latents.ndim != 4 or latents.shape[1] != vae.config.z_channels:
        raise ValueError(f"decode_latents expects latents (B, {vae.config.z_channels}, h, w), got shape "
                         f"{tuple(latents.shape)}{hint}")


def decode_model_latents(vae, latents, fmt, hint=""):
    """Model-space latents (B, z, h, w) -> images (B, 3, H, W) in [-1, 1] (nominally; not clamped), in the VAE's
    dtype, on its device: fmt.from_model in float32, then the decoder."""
    check_latents(vae, latents, hint)
    with flame.no_grad():
        z = fmt.from_model(latents.to(vae.device).float())
        return vae.decode(z.to(vae.dtype))


def encode_model_latents(vae, images, fmt, generator=None):
    """Images (B, 3, H, W) in [-1, 1] -> model-space latents (B, z, h, w) float32: fmt.to_model of the posterior
    mean, or of a posterior sample drawn from `generator`."""
    with flame.no_grad():
        z = vae.encode(images.to(vae.device).to(vae.dtype), generator=generator)
        return fmt.to_model(z.float())
