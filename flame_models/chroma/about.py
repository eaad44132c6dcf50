"""What the registry knows of Chroma (flame_models/registry.py). Its files carry Flux's block names too, so its
marks (the approximator) are tried before Flux's (refines)."""
from ..bfl.vae import LATENT_FORMAT
from ..registry import About

ABOUT = About(
    name="chroma", label="Chroma", model_words="a Chroma transformer", header_kind="chroma",
    file_words="a Chroma transformer",
    key_marks=("distilled_guidance_layer.in_proj.weight",), pipeline_classes=("Chroma",),
    latent_format=LATENT_FORMAT, trainer="ChromaFamily", toolkit_flag=None, refines="flux")
