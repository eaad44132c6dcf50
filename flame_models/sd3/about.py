"""What the registry knows of SD3 / SD3.5 (flame_models/registry.py)."""
from ..registry import About
from ..vae.latent_format import LatentFormat

ABOUT = About(
    name="sd3", label="SD3", model_words="an SD3 / SD3.5 MMDiT", header_kind="sd3",
    file_words="an SD3 (MMDiT) transformer",
    key_marks=("joint_blocks.0.x_block.attn.qkv.weight", "pos_embed.proj.weight"),
    pipeline_classes=("StableDiffusion3",),
    latent_format=LatentFormat(scaling_factor=1.5305, shift_factor=0.0609),
    trainer="SD3Family", toolkit_flag="is_v3")
