"""What the registry knows of Flux (flame_models/registry.py)."""
from ..registry import About
from ..vae.latent_format import LatentFormat

ABOUT = About(
    name="flux", label="Flux", model_words="a Flux transformer", header_kind="flux",
    file_words="a Flux transformer",
    key_marks=("double_blocks.0.img_attn.qkv.weight", "single_transformer_blocks.0.attn.to_q.weight"),
    pipeline_classes=("Flux",),
    latent_format=LatentFormat(scaling_factor=0.3611, shift_factor=0.1159),
    trainer="FluxFamily", toolkit_flag="is_flux")
