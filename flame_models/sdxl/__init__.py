"""SDXL: the UNet (SAI's UNetModel with text_time conditioning), checkpoint loading / saving (SAI single files and
diffusers folders), the y vector, LoRA names and text-to-image sampling.

    unet = load_unet("sd_xl_base_1.0.safetensors", dtype=flame.bfloat16, device="cuda")
    y = make_y(pooled, original_size=(1024, 1024), crop_coords=(0, 0), target_size=(1024, 1024))
    eps = unet(latents, timesteps, context, y)                  # (B, 4, H, W); context (B, 77, 2048), y (B, 2816)
    z = sample(unet, context, y, neg_context, neg_y, height=1024, width=1024, steps=30, cfg=5.0)
    parts = load_sdxl("sd_xl_base_1.0.safetensors")          # UNet, VAE, CLIP-L, CLIP-G and tokenizers
    save_sdxl(parts, "sdxl/", layout="diffusers")

The text-to-image pipeline (prompt encoding, VAE, LoRAs, sampling stages) is flame_models.sdxl.pipeline.
"""
from .attention import GEGLU, BasicTransformerBlock, CrossAttention, FeedForward, SpatialTransformer
from .components import SDXLFiles, SDXLFilesError, find_sdxl_files
from .config import UNetConfig, UNetConfigError, configs, unet_config
from .embeddings import make_y, size_embeddings, timestep_embedding
from .keys import diffusers_to_sai_key, sai_to_diffusers_key
from .loading import UNetCheckpoint, UNetCheckpointError, infer_config, load_unet, load_unet_state_
from .lora_keys import (
                        CONV_TARGETS,
                        KOHYA_METADATA,
                        PEFT_PREFIX,
                        RESNET_LINEAR_TARGETS,
                        TARGET_PRESETS,
                        kohya_diffusers_to_sai,
                        unet_name_map,
)
from .model import SDXLUNet
from .parts import SDXLParts, load_sdxl, save_sdxl
from .resblocks import Downsample, ResBlock, TimestepEmbedSequential, Upsample
from .sampling import cfg_model, sample
from .saving import save_unet

UNetModel = SDXLUNet  # SAI's class name

__all__ = ["UNetConfig", "UNetConfigError", "configs", "unet_config", "timestep_embedding", "size_embeddings",
           "make_y", "ResBlock", "Downsample", "Upsample", "TimestepEmbedSequential", "CrossAttention", "GEGLU",
           "FeedForward", "BasicTransformerBlock", "SpatialTransformer", "SDXLUNet", "UNetModel",
           "sai_to_diffusers_key", "diffusers_to_sai_key", "UNetCheckpointError", "UNetCheckpoint", "infer_config",
           "load_unet", "load_unet_state_", "save_unet", "TARGET_PRESETS", "CONV_TARGETS", "RESNET_LINEAR_TARGETS",
           "PEFT_PREFIX", "KOHYA_METADATA",
           "unet_name_map", "kohya_diffusers_to_sai", "cfg_model", "sample", "SDXLFiles", "SDXLFilesError",
           "find_sdxl_files", "SDXLParts", "load_sdxl", "save_sdxl"]
