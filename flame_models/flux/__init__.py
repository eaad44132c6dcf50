"""FLUX.1 transformer: model, checkpoint loading/saving (BFL and diffusers layouts) and sampling.

The transformer and its pipeline parts are shared with the Flux-derived families (Kontext, Chroma), so they live in
flame_models/bfl; this family's modules of the same names are those modules (flame_models.flux.layers is
flame_models.bfl.layers), so code written against flame_models.flux.<module> keeps working."""
import sys

from ..bfl import *  # noqa: F401,F403
from ..bfl import (
    __all__,
    components,
    conditioning,
    family_parts,
    keys,
    layers,
    loading,
    lora_keys,
    model,
    ops,
    params,
    sampling,
    tiny,
)

for _m in (components, conditioning, family_parts, keys, layers, loading, lora_keys, model, ops, params, sampling,
           tiny):
    sys.modules[f"{__name__}.{_m.__name__.rpartition('.')[2]}"] = _m
del _m
