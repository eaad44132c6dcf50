"""Qwen-Image LoRA target presets. FLAME's module names are diffusers' (= the release's), so the PEFT names are the
module names under `transformer.` (the model's adapter_name_map maps each Linear to itself; diffusers'
QwenImagePipeline.load_lora_weights reads them as they are, ComfyUI maps `transformer.<name>`), and kohya files name
`lora_unet_<name with '_'>` (diffusers converts those, ComfyUI reads them)."""
TARGET_PRESETS = {
    # diffusers' train_dreambooth_lora_qwen_image default: the image stream's attention projections
    "attention": ["to_q", "to_k", "to_v", "to_out.0"],
    # both streams' attention projections
    "attention_all": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    # every Linear of the dual-stream blocks (attention, MLPs, modulation)
    "all_linear": ["transformer_blocks.*"],
}
