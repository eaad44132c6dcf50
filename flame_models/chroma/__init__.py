"""Chroma (lodestones' Chroma1, 8.9B, FLUX.1-schnell-derived): T5-only conditioning with its padding mask, the
approximator making the modulation vectors, Flux's double / single blocks; loading of Chroma's, ComfyUI's and
diffusers' files; the trainer plug-in and `generate` part with CFG and negative prompts."""
from .loading import (
                      ChromaCheckpointError,
                      chroma_params_from_config,
                      load_chroma,
                      load_chroma_state_,
                      read_chroma_params,
                      save_chroma,
)
from .model import Chroma, attended_text
from .params import ChromaParams, chroma_params, configs

__all__ = ["ChromaParams", "configs", "chroma_params", "Chroma", "attended_text", "ChromaCheckpointError",
           "chroma_params_from_config", "load_chroma", "load_chroma_state_", "read_chroma_params", "save_chroma"]
