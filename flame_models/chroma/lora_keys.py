"""Chroma LoRA names: its Linear names (Chroma's / BFL's) <-> diffusers' (PEFT) names, and the target presets.

The blocks' Linears are Flux's (flame_models.bfl.lora_keys: fused qkv and linear1 split into to_q / to_k / to_v /
proj_mlp row ranges) without the modulation Linears Chroma does not have; the approximator's `layers.{l}.in_layer /
out_layer` are diffusers' `linear_1 / linear_2`, its in_proj / out_proj have the same names in both. kohya / ComfyUI
files use the Chroma names with `lora_unet_`.
"""
from flame_nn.adapters.formats import NameMap

from ..bfl.lora_keys import TARGET_PRESETS as _FLUX_PRESETS
from ..bfl.lora_keys import flux_name_map

_NOT_IN_CHROMA = ("_mod.lin", "modulation.lin", "time_in.", "vector_in.", "guidance_in.", "adaLN_modulation")


def chroma_name_map(depth=19, depth_single_blocks=38, hidden_size=3072, mlp_hidden=12288, out_channels=64,
                    approximator_hidden_dim=5120, approximator_layers=5):
    """NameMap for a Chroma of the given size (defaults: Chroma1)."""
    flux = flux_name_map(depth, depth_single_blocks, hidden_size, mlp_hidden, False, out_channels)
    t = {k: v for k, v in flux.targets.items() if not any(s in k for s in _NOT_IN_CHROMA)}
    A, g = approximator_hidden_dim, "distilled_guidance_layer"
    t[f"{g}.in_proj"] = [(f"{g}.in_proj", [(0, A)])]            # (the same names in diffusers)
    t[f"{g}.out_proj"] = [(f"{g}.out_proj", [(0, hidden_size)])]
    for l in range(approximator_layers):  # noqa: E741
        t[f"{g}.layers.{l}.in_layer"] = [(f"{g}.layers.{l}.linear_1", [(0, A)])]
        t[f"{g}.layers.{l}.out_layer"] = [(f"{g}.layers.{l}.linear_2", [(0, A)])]
    return NameMap(t)


def name_map_for(params):
    """NameMap for a ChromaParams."""
    return chroma_name_map(params.depth, params.depth_single_blocks, params.hidden_size, params.mlp_hidden_dim,
                           params.out_channels, params.approximator_hidden_dim, params.approximator_layers)


# Flux's presets (their patterns name block Linears both models have); "all_linear" covers the blocks only, as
# kohya's Flux default does -- the approximator stays frozen unless named.
TARGET_PRESETS = dict(_FLUX_PRESETS)
