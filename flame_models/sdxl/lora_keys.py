"""SDXL LoRA names: the model's (SAI) Linear names <-> diffusers' (PEFT files), the target presets, and kohya files
that use diffusers' module names.

kohya sd-scripts trains SDXL on its own SAI-named UNet (library/sdxl_original_unet.py), so its files -- and FLAME's
kohya output -- name modules `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`; diffusers writes PEFT
files `unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight`. ComfyUI reads both, and also
kohya-style keys built from diffusers names (`lora_unet_down_blocks_1_attentions_0_...`, what diffusers' own kohya
conversion writes); `kohya_diffusers_to_sai` renames those to the first form.

Adapters cover Linears only (flame_nn.adapters has no Conv2d adapter), so there is no LoCon preset: kohya's conv_dim
targets (the ResBlocks' 3x3 convs, the down/upsample convs) cannot be trained here yet.
"""
import flame_nn
from flame_nn.adapters.formats import KOHYA_PREFIX, NameMap, kohya_name

from . import keys as K

PEFT_PREFIX = "unet."

# what kohya sd-scripts writes into an SDXL LoRA's metadata (pass as save_adapters(..., metadata=KOHYA_METADATA);
# flame_nn's own default names the Flux network module)
KOHYA_METADATA = {"ss_network_module": "networks.lora", "ss_base_model_version": "sdxl_base_v1-0",
                  "modelspec.architecture": "stable-diffusion-xl-v1-base/lora"}

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


def _linear_names(unet):
    """[(module name, out_features)] of every Linear of the model (adapted ones included)."""
    return [(n, m.weight.shape[0]) for n, m in unet.named_modules() if isinstance(m, flame_nn.Linear)]


def unet_name_map(unet):
    """NameMap for `unet` (an SDXLUNet): each SAI Linear name -> its diffusers name, all output rows."""
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
            raise KeyError(f"kohya key {key!r} names no Linear of this UNet (in SAI or diffusers names)")
        out[to_sai[module] + dot + suffix] = value
    return out
