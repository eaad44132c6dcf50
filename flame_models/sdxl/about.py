"""What the registry knows of SDXL (flame_models/registry.py)."""
from ..registry import About
from ..vae.latent_format import LatentFormat

# (diffusers' VAE has down_blocks.0.resnets too: the time embedding tells a UNet)
ABOUT = About(
    name="sdxl", label="SDXL", model_words="an SDXL UNet", header_kind="unet",
    file_words="a Stable Diffusion / SDXL UNet",
    key_marks=("input_blocks.0.0.weight", "time_embedding.linear_1.weight"),
    pipeline_classes=("StableDiffusionXL",),
    latent_format=LatentFormat(scaling_factor=0.13025, shift_factor=0.0),
    trainer="SDXLFamily", toolkit_flag="is_xl")
