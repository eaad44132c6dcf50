"""FLUX.1 transformer: model, checkpoint loading/saving (BFL and diffusers layouts) and sampling.

The transformer and its pipeline parts are shared with the Flux-derived families (Kontext, Chroma), so they live in
flame_models/bfl; this family's modules of the same names are those modules (flame_models.flux.layers is
flame_models.bfl.layers), so code written against flame_models.flux.<module> keeps working."""
import importlib
import sys

from ..bfl import *  # noqa: F401,F403
from ..bfl import __all__  # noqa: F401

_SHARED = ("components", "keys", "layers", "loading", "lora_keys", "model", "ops", "params", "sampling")
_TRAIN_EXTRA = ("conditioning", "family_parts", "tiny")   # need the train extra's tokenizers


def _alias(name):
    sys.modules[f"{__name__}.{name}"] = module = importlib.import_module(f"flame_models.bfl.{name}")
    globals()[name] = module


for _name in _SHARED:
    _alias(_name)
for _name in _TRAIN_EXTRA:
    try:
        _alias(_name)
    except ModuleNotFoundError as e:   # a base install (no train extra): the model and loaders still import
        if e.name not in ("tokenizers", "sentencepiece"):
            raise
del _name
