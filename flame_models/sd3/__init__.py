"""SD3 / SD3.5 transformer (MMDiT, and MMDiT-X for 3.5 Medium): model, checkpoint loading/saving (SAI and diffusers
layouts), sampling (shifted flow-matching schedule, Euler with CFG and skip-layer guidance), LoRA names, and finding a
whole model's parts (find_sd3_files). The text-to-image pipeline (prompt encoding, VAE, LoRAs, sampling stages) is
flame_models.sd3.pipeline."""
from .components import SD3Files, SD3FilesError, find_sd3_files
from .layers import DismantledBlock, Embedder, JointBlock, Mlp, PatchEmbed, RMSNorm, SelfAttention
from .loading import SD3CheckpointError, load_sd3, load_sd3_state_, save_sd3
from .lora_keys import KOHYA_METADATA, TARGET_PRESETS, name_map_for, sd3_name_map
from .model import MMDiT
from .params import SD3Params, configs, sd3_params
from .sampling import (
                       LATENT_SCALE,
                       LATENT_SHIFT,
                       SAMPLING_DEFAULTS,
                       SHIFT,
                       SkipLayerGuidance,
                       denoise,
                       get_noise,
                       get_sigmas,
                       sample,
                       shift_sigma,
)

__all__ = ["SD3Params", "configs", "sd3_params", "PatchEmbed", "Embedder", "RMSNorm", "SelfAttention", "Mlp",
           "DismantledBlock", "JointBlock", "MMDiT", "load_sd3", "load_sd3_state_", "save_sd3", "SD3CheckpointError",
           "SHIFT", "LATENT_SCALE", "LATENT_SHIFT", "SAMPLING_DEFAULTS", "SkipLayerGuidance", "shift_sigma",
           "get_sigmas", "get_noise", "denoise", "sample", "TARGET_PRESETS", "KOHYA_METADATA", "sd3_name_map",
           "name_map_for", "SD3Files", "SD3FilesError", "find_sd3_files"]
