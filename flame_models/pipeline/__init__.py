"""Sampling-time stages every text-to-image family shares: LoRA files checked and applied to a model (loras.py), a
model loaded and placed for sampling -- merged LoRAs, fp8 storage, streamed blocks -- and freed (placement.py),
and images out (images.py). A family's pipeline (flux/pipeline.py, sd3/pipeline.py, sdxl/pipeline.py) composes
them with its own encoders, model and VAE."""
from .images import to_pil
from .loras import (
                    apply_loras,
                    apply_text_encoder_loras,
                    check_lora_part,
                    check_loras,
                    lora_parts,
                    loras_for,
                    parse_lora,
                    refuse_streamed_encoder_loras,
)
from .placement import free_model, load_for_sampling, place_for_inference

__all__ = ["to_pil", "apply_loras", "apply_text_encoder_loras", "check_lora_part", "check_loras", "lora_parts",
           "loras_for", "parse_lora", "refuse_streamed_encoder_loras", "free_model", "load_for_sampling",
           "place_for_inference"]
