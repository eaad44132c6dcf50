"""FLUX.1 transformer: model, checkpoint loading/saving (BFL and diffusers layouts) and sampling."""
from .params import FluxParams, configs, flux_params
from .layers import (EmbedND, timestep_embedding, MLPEmbedder, RMSNorm, QKNorm, SelfAttention, Modulation,
                     DoubleStreamBlock, SingleStreamBlock, LastLayer)
from .model import Flux
from .loading import load_flux, load_flux_state_, save_flux, read_flux_params, FluxCheckpointError
from .sampling import pack, unpack, image_ids, text_ids, get_schedule, get_noise, denoise, sample

__all__ = ["FluxParams", "configs", "flux_params", "EmbedND", "timestep_embedding", "MLPEmbedder", "RMSNorm",
           "QKNorm", "SelfAttention", "Modulation", "DoubleStreamBlock", "SingleStreamBlock", "LastLayer", "Flux",
           "load_flux", "load_flux_state_", "save_flux", "read_flux_params", "FluxCheckpointError", "pack", "unpack",
           "image_ids", "text_ids", "get_schedule", "get_noise", "denoise", "sample"]
