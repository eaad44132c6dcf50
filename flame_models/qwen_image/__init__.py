"""Qwen-Image (Qwen's 20B MMDiT text-to-image model): the transformer (60 dual-stream blocks, 3-axis RoPE with
centred image positions, the text-padding mask) with diffusers' names and argument names, loading of diffusers
folders and ComfyUI files, the pipeline's sampler (sampling.py) and the trainer plug-in (family.py: precomputed or
synthetic samples). Not here yet: the Qwen2.5-VL text encoder and the Wan-style VAE (so no image folders, no
`generate`)."""
from .loading import (
    QwenImageCheckpointError,
    load_qwen_image,
    load_qwen_image_state_,
    params_from_config,
    read_qwen_image_params,
    save_qwen_image,
)
from .model import QwenImageTransformer2DModel
from .params import QwenImageParams, configs, qwen_image_params
from .positions import position_ids

__all__ = ["QwenImageParams", "configs", "qwen_image_params", "QwenImageTransformer2DModel", "position_ids",
           "QwenImageCheckpointError", "load_qwen_image", "load_qwen_image_state_", "params_from_config",
           "read_qwen_image_params", "save_qwen_image"]
