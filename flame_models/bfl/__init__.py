"""FLUX.1's transformer and the parts of its pipeline, shared by the Flux-derived families (flame_models/flux,
flux_kontext, chroma; docs/ARCHITECTURES.md): Black Forest Labs' blocks and model in their checkpoint names, the
BFL <-> diffusers key plans, latent packing and the Euler sampler, finding a Flux model's files, CLIP-L + T5 prompt
encoding, the VAE stage, tiny random folders and the trainer plug-in the families specialise. No family lives
here: each family's folder imports what it needs from this package."""
from .layers import (
                     DoubleStreamBlock,
                     EmbedND,
                     LastLayer,
                     MLPEmbedder,
                     Modulation,
                     QKNorm,
                     RMSNorm,
                     SelfAttention,
                     SingleStreamBlock,
                     timestep_embedding,
)
from .loading import (
                     FluxCheckpointError,
                     flux_params_from_config,
                     load_flux,
                     load_flux_state_,
                     read_flux_params,
                     save_flux,
)
from .model import Flux
from .params import FluxParams, configs, flux_params
from .sampling import denoise, get_noise, get_schedule, image_ids, pack, sample, text_ids, unpack

__all__ = ["FluxParams", "configs", "flux_params", "EmbedND", "timestep_embedding", "MLPEmbedder", "RMSNorm",
           "QKNorm", "SelfAttention", "Modulation", "DoubleStreamBlock", "SingleStreamBlock", "LastLayer", "Flux",
           "load_flux", "load_flux_state_", "save_flux", "read_flux_params", "flux_params_from_config",
           "FluxCheckpointError", "pack", "unpack", "image_ids", "text_ids", "get_schedule", "get_noise", "denoise",
           "sample"]
