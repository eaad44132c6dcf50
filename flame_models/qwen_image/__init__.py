"""Qwen-Image (Qwen's 20B MMDiT text-to-image model): the transformer (60 dual-stream blocks, 3-axis RoPE with
centred image positions, the text-padding mask) with diffusers' names and argument names, loading of diffusers
folders and ComfyUI files, the VAE for single images (vae.py: load_vae of a diffusers vae/ folder), the pipeline's
prompt template (conditioning.py, over flame_models.text_encoders.qwen2_5_vl), its sampler (sampling.py) and the
trainer plug-in (family.py, family_parts.py: image folders through the VAE and the Qwen2.5-VL language model with
its tokenizer, tokenization/qwen2.py), `generate` (generate.py) and a tiny random pipeline folder (tiny.py). Not
here yet: ComfyUI's / Wan's VAE layout; a text encoder given as a separate single file for a lone transformer file;
fp8 / streaming of the 7B text encoder."""
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
from .vae import AutoencoderKLQwenImage, QwenImageVAEConfig, load_vae

__all__ = ["QwenImageParams", "configs", "qwen_image_params", "QwenImageTransformer2DModel", "position_ids",
           "QwenImageCheckpointError", "load_qwen_image", "load_qwen_image_state_", "params_from_config",
           "read_qwen_image_params", "save_qwen_image", "AutoencoderKLQwenImage", "QwenImageVAEConfig", "load_vae"]
