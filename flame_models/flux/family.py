"""FLUX.1 as a trainer family: flame_models.bfl.family.FluxFamily (shared with the Flux-derived families, which
specialise it)."""
from ..bfl.family import FluxFamily

__all__ = ["FluxFamily"]
