"""Text encoders of the diffusion models: the CLIP text transformer (CLIP-L, CLIP-G/bigG) and the T5 v1.1
encoder (T5-XXL), with transformers' names, outputs and checkpoint keys, loaded from transformers / diffusers
folders, ComfyUI single files, OpenCLIP layouts and SDXL / SD3 checkpoints (fp8 storage and block streaming for T5).

    from flame_models.text_encoders import load_clip, load_t5
    clip = load_clip("FLUX.1-dev/", dtype=flame.bfloat16, device="cuda")
    t5 = load_t5("FLUX.1-dev/", dtype=flame.bfloat16, device="cuda", quantize="fp8")
    pooled = clip(ids_77).pooler_output                      # (B, 768)
    txt = t5(ids_512).last_hidden_state                       # (B, 512, 4096)
    encode = GraphedEncoder(clip)                             # CUDA graph replays for repeated shapes
    tiny = CLIPTextModel(CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4))   # random weights
    tiny.save_pretrained("tiny_clip/")                        # a transformers folder; load_clip reads it back
"""
from flame_nn.functional import quick_gelu

from .clip import CLIPTextModel, CLIPTextModelWithProjection
from .configs import (
                      CLIP_PRESETS,
                      T5_PRESETS,
                      CLIPTextConfig,
                      T5Config,
                      TextEncoderConfigError,
                      infer_clip_config,
                      infer_t5_config,
)
from .files import TextEncoderCheckpointError
from .graphed import GraphedEncoder
from .loading import load_clip, load_t5
from .outputs import BaseModelOutput, BaseModelOutputWithPooling, CLIPTextModelOutput, ModelOutput
from .structure import is_structure_only, structure_only
from .t5 import T5EncoderModel, relative_position_bucket

__all__ = ["CLIPTextConfig", "T5Config", "TextEncoderConfigError", "CLIP_PRESETS", "T5_PRESETS",
           "infer_clip_config", "infer_t5_config", "ModelOutput", "BaseModelOutput", "BaseModelOutputWithPooling",
           "CLIPTextModelOutput", "CLIPTextModel", "CLIPTextModelWithProjection", "quick_gelu", "T5EncoderModel",
           "relative_position_bucket", "TextEncoderCheckpointError", "load_clip", "load_t5", "GraphedEncoder",
           "structure_only", "is_structure_only"]
