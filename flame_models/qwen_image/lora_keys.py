"""Qwen-Image LoRA names and target presets. FLAME's module names are diffusers' (= the release's), so the PEFT
names are the module names under `transformer.` (diffusers' QwenImagePipeline.load_lora_weights reads them as they
are; ComfyUI maps `transformer.<name>`), and kohya files name `lora_unet_<name with '_'>` (diffusers converts those,
ComfyUI reads them)."""
from flame_nn.adapters.formats import NameMap

NAME_MAP = NameMap()

TARGET_PRESETS = {
    # diffusers' train_dreambooth_lora_qwen_image default: the image stream's attention projections
    "attention": ["to_q", "to_k", "to_v", "to_out.0"],
    # both streams' attention projections
    "attention_all": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    # every Linear of the dual-stream blocks (attention, MLPs, modulation)
    "all_linear": ["transformer_blocks.*"],
}
