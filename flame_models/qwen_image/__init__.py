"""Qwen-Image (Qwen's 20B MMDiT text-to-image model): the transformer (60 dual-stream blocks, 3-axis RoPE with
centred image positions, the text-padding mask) with diffusers' names and argument names, and loading of diffusers
folders and ComfyUI files. The Qwen2.5-VL text encoder, the Wan-style VAE and the trainer plug-in are not here yet."""
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
