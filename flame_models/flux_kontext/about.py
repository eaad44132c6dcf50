"""What the registry knows of Flux Kontext (flame_models/registry.py). Its transformer files are FLUX.1-dev's (the
same tensors): a diffusers FluxKontextPipeline folder is recognised, a single file needs `--arch flux_kontext`."""
from ..bfl.vae import LATENT_FORMAT
from ..registry import About

ABOUT = About(
    name="flux_kontext", label="Flux Kontext", model_words="a Flux Kontext transformer", header_kind="flux",
    file_words="a Flux transformer", key_marks=(), pipeline_classes=("FluxKontext",),
    latent_format=LATENT_FORMAT, trainer="FluxKontextFamily", toolkit_flag=None, refines="flux")
