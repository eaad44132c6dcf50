"""The LDM AutoencoderKL (SDXL, SD3, Flux VAEs): model, checkpoint loading, tiling and the families' latent scale.

    vae = load_vae("ae.safetensors", dtype=flame.bfloat16, device="cuda")
    z = vae.encode(images)              # (B, 16, H/8, W/8) unscaled posterior mean; images in [-1, 1]
    x = vae.decode(z)                   # (B, 3, H, W), nominally [-1, 1]
    z_model = registry.latent_format("flux").to_model(z)   # what the transformer sees (flame_models.registry)
"""
from .config import AutoencoderKLConfig, VAEConfig, VAEConfigError, configs, vae_config
from .distribution import DiagonalGaussianDistribution
from .family import check_latents, decode_model_latents, encode_model_latents, load_family_vae
from .latent_format import LatentFormat
from .layers import AttnBlock, Downsample, MidBlock, ResnetBlock, Upsample
from .loading import VAECheckpoint, VAECheckpointError, infer_config, load_vae, load_vae_state_
from .model import AutoencoderKL, Decoder, Encoder
from .saving import save_vae
from .tiling import blend_h, blend_v, tiled_decode, tiled_encode

__all__ = ["VAEConfig", "AutoencoderKLConfig", "VAEConfigError", "configs", "vae_config",
           "DiagonalGaussianDistribution", "LatentFormat", "AttnBlock",
           "Downsample", "MidBlock", "ResnetBlock", "Upsample", "AutoencoderKL", "Decoder", "Encoder",
           "VAECheckpointError", "VAECheckpoint", "infer_config", "load_vae", "load_vae_state_", "save_vae",
           "load_family_vae", "check_latents", "decode_model_latents", "encode_model_latents", "blend_h", "blend_v",
           "tiled_decode", "tiled_encode"]
