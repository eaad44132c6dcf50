"""What the registry knows of Qwen-Image (flame_models/registry.py)."""
from ..registry import About
from .latents import LATENT_FORMAT

ABOUT = About(
    name="qwen_image", label="Qwen-Image", model_words="a Qwen-Image transformer", header_kind="qwen_image",
    file_words="a Qwen-Image transformer", key_marks=(".img_mod.1.weight", "txt_norm.weight"),
    pipeline_classes=("QwenImagePipeline",), latent_format=LATENT_FORMAT, trainer="QwenImageFamily",
    toolkit_flag=None)
