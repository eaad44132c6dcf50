"""SDXL LoRA names: the model's (SAI) Linear names <-> diffusers' (PEFT files), the target presets, and kohya files
that use diffusers' module names.

kohya sd-scripts trains SDXL on its own SAI-named UNet (library/sdxl_original_unet.py), so its files -- and FLAME's
kohya output -- name modules `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`; diffusers writes PEFT
files `unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight`. Which client reads which:
ComfyUI and diffusers (load_lora_weights) both read the kohya layout, so the trainer writes it by default; diffusers
reads the PEFT layout, but ComfyUI's key map does not read its attention keys (it maps `unet.….attn1.processor.to_q`,
not `unet.….attn1.to_q`: those adapters are left out and the attention stays at base). ComfyUI also reads
kohya-style keys built from diffusers names (`lora_unet_down_blocks_1_attentions_0_...`, what diffusers' own kohya
conversion writes); `kohya_diffusers_to_sai` renames those to the first form.

The name map covers the convolutions too (LoCon: LoRA on Conv2d, flame_nn.adapters.locon): conv_in
input_blocks.0.0, the ResBlocks' in_layers.2 / out_layers.3 / skip_connection (conv1 / conv2 / conv_shortcut), the
downsamplers' op, the upsamplers' conv, conv_out out.2. kohya's LoCon (networks/lora.py with conv_dim) adapts every
layer of its ResnetBlock2D / Downsample2D / Upsample2D modules: 3x3 convolutions with conv_dim / conv_alpha, the
Linear (emb_layers.1) and 1x1 convolutions (skip_connection) with the network's dim / alpha; conv_in and conv_out are
left alone. CONV_TARGETS and RESNET_LINEAR_TARGETS are those two sets.
"""
import flame_nn
from flame_nn.adapters.formats import KOHYA_PREFIX, NameMap, kohya_name

from . import keys as K

PEFT_PREFIX = "unet."

# what kohya sd-scripts writes into an SDXL LoRA's metadata (pass as save_adapters(..., metadata=KOHYA_METADATA);
# flame_nn's own default names the Flux network module)
KOHYA_METADATA = {"ss_network_module": "networks.lora", "ss_base_model_version": "sdxl_base_v1-0",
                  "modelspec.architecture": "stable-diffusion-xl-v1-base/lora"}

# kohya's text-encoder targets (TEXT_ENCODER_TARGET_REPLACE_MODULE = CLIPAttention, CLIPMLP): every Linear of the
# CLIP layers' attention and MLP, in transformers' names (files: lora_te1_text_model_encoder_layers_0_self_attn_q_proj)
TEXT_ENCODER_TARGETS = [r"re:text_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
                        r"re:text_model\.encoder\.layers\.\d+\.mlp\.(fc1|fc2)"]

_TRANSFORMER_LINEARS = [r"re:.*\.(proj_in|proj_out)",
                        r"re:.*\.transformer_blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"]

# Target presets as name patterns (flame_nn.adapters.inject.matches), in the model's SAI names
TARGET_PRESETS = {
    # diffusers' train_dreambooth_lora_sdxl default (and the issue's benchmark): the attention projections
    "attention": ["to_q", "to_k", "to_v", "to_out.0"],
    # kohya's default for SDXL (UNET_TARGET_REPLACE_MODULE = Transformer2DModel): every Linear of the transformers
    "all_linear": list(_TRANSFORMER_LINEARS),
    # ... plus the ResBlocks' time-embedding projections (kohya adds them along with its conv targets)
    "all_linear_resnet": _TRANSFORMER_LINEARS + [r"re:.*\.emb_layers\.1"],
}


# kohya's LoCon targets (conv_dim): the 3x3 convolutions of the ResBlocks, downsamplers and upsamplers (conv rank) ...
CONV_TARGETS = [r"re:.*\.(in_layers\.2|out_layers\.3)", r"re:input_blocks\.\d+\.0\.op",
                r"re:output_blocks\.\d+\.\d+\.conv"]
# ... and what else those modules hold, at the network's (linear) rank: the time-embedding Linear, the 1x1 skip conv
RESNET_LINEAR_TARGETS = [r"re:.*\.emb_layers\.1", r"re:.*\.skip_connection"]


def _linear_names(unet):
    """[(module name, out_features)] of every Linear and Conv2d of the model (adapted ones included)."""
    return [(n, m.weight.shape[0]) for n, m in unet.named_modules()
            if isinstance(m, (flame_nn.Linear, flame_nn.Conv2d))]


def unet_name_map(unet):
    """NameMap for `unet` (an SDXLUNet): each SAI Linear and Conv2d name -> its diffusers name, all output rows."""
    nrb = unet.config.num_res_blocks
    return NameMap({name: [(K.sai_to_diffusers_key(name + ".weight", nrb)[:-len(".weight")], [(0, out)])]
                    for name, out in _linear_names(unet)}, peft_prefix=PEFT_PREFIX)


def kohya_diffusers_to_sai(state_dict, unet, prefix=KOHYA_PREFIX):
    """A kohya-format state dict whose module names are diffusers' (`lora_unet_down_blocks_1_attentions_0_...`)
    renamed to the SAI names the model and kohya's SDXL files use; keys already in SAI names pass through. Raises
    KeyError naming the first key that matches neither."""
    nrb = unet.config.num_res_blocks
    to_sai = {}
    for name, _ in _linear_names(unet):
        diffusers = K.sai_to_diffusers_key(name + ".weight", nrb)[:-len(".weight")]
        to_sai[kohya_name(diffusers, prefix)] = kohya_name(name, prefix)
        to_sai[kohya_name(name, prefix)] = kohya_name(name, prefix)
    out = {}
    for key, value in state_dict.items():
        module, dot, suffix = key.partition(".")
        if module not in to_sai:
            raise KeyError(f"kohya key {key!r} names no Linear or Conv2d of this UNet (in SAI or diffusers names)")
        out[to_sai[module] + dot + suffix] = value
    return out
