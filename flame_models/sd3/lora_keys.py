"""SD3 LoRA names: FLAME/SAI Linear names <-> diffusers (PEFT) names, with the fused-qkv row splits, and the target
presets.

FLAME's MMDiT follows SAI's checkpoint (fused attn.qkv per stream; kohya/ComfyUI files name it
`lora_unet_joint_blocks_N_x_block_attn_qkv`). diffusers splits each qkv into to_q / to_k / to_v (x stream, and attn2's
in MMDiT-X) or add_q_proj / add_k_proj / add_v_proj (context stream), so one FLAME Linear maps to three diffusers
Linears, each a third of its output rows (PEFT files: `transformer.transformer_blocks.N.attn.to_q.lora_A.weight`).
The final layer's adaLN and the last block's pre-only context adaLN are the permutations: diffusers chunks them
(scale, shift), SAI (shift, scale).

Which client reads which: ComfyUI reads both layouts; diffusers 0.42 loads nothing from the kohya layout (it has no
conversion for `lora_unet_joint_blocks_…`), so the trainer writes PEFT files for SD3 by default (save.format).
"""
from flame_nn.adapters.formats import NameMap

from .params import sd3_params


def sd3_name_map(params="sd3.5-large"):
    """NameMap for an MMDiT of these params (an SD3Params or a preset name)."""
    p = sd3_params(params)
    H, M = p.hidden_size, p.mlp_hidden_dim
    one = lambda name, n: [(name, [(0, n)])]  # noqa: E731

    def qkv(prefix, names):
        return [(f"{prefix}.{n}", [(j * H, (j + 1) * H)]) for j, n in enumerate(names)]

    t = {}
    for i in range(p.depth):
        b, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        last = i == p.depth - 1
        t[f"{b}.x_block.attn.qkv"] = qkv(d, ("attn.to_q", "attn.to_k", "attn.to_v"))
        t[f"{b}.x_block.attn.proj"] = one(f"{d}.attn.to_out.0", H)
        if i in p.dual_attention_layers:
            t[f"{b}.x_block.attn2.qkv"] = qkv(d, ("attn2.to_q", "attn2.to_k", "attn2.to_v"))
            t[f"{b}.x_block.attn2.proj"] = one(f"{d}.attn2.to_out.0", H)
        t[f"{b}.x_block.mlp.fc1"] = one(f"{d}.ff.net.0.proj", M)
        t[f"{b}.x_block.mlp.fc2"] = one(f"{d}.ff.net.2", H)
        n_x = 9 if i in p.dual_attention_layers else 6
        t[f"{b}.x_block.adaLN_modulation.1"] = one(f"{d}.norm1.linear", n_x * H)
        t[f"{b}.context_block.attn.qkv"] = qkv(d, ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))
        if last:
            t[f"{b}.context_block.adaLN_modulation.1"] = [(f"{d}.norm1_context.linear", [(H, 2 * H), (0, H)])]
        else:
            t[f"{b}.context_block.attn.proj"] = one(f"{d}.attn.to_add_out", H)
            t[f"{b}.context_block.mlp.fc1"] = one(f"{d}.ff_context.net.0.proj", M)
            t[f"{b}.context_block.mlp.fc2"] = one(f"{d}.ff_context.net.2", H)
            t[f"{b}.context_block.adaLN_modulation.1"] = one(f"{d}.norm1_context.linear", 6 * H)
    for sai, dif in (("t_embedder", "timestep_embedder"), ("y_embedder", "text_embedder")):
        t[f"{sai}.mlp.0"] = one(f"time_text_embed.{dif}.linear_1", H)
        t[f"{sai}.mlp.2"] = one(f"time_text_embed.{dif}.linear_2", H)
    t["context_embedder"] = one("context_embedder", H)
    t["final_layer.linear"] = one("proj_out", p.patch_size ** 2 * p.out_channels)
    t["final_layer.adaLN_modulation.1"] = [("norm_out.linear", [(H, 2 * H), (0, H)])]
    return NameMap(t)


def name_map_for(config):
    """NameMap for an SD3Params (the trainer family's hook, as flame_models.flux.lora_keys.name_map_for)."""
    return sd3_name_map(config)


# Target presets, as name patterns (see flame_nn.adapters.inject.matches). A pattern may name FLAME Linears or
# diffusers Linears; the latter become adapters on row ranges of the fused FLAME Linear.
TARGET_PRESETS = {
    # the peer's choice (issue 28's bench): to_q/to_k/to_v/to_out.0 -- the x stream's attention (and attn2's in
    # MMDiT-X, as PEFT's suffix match selects them too)
    "attention": ["to_q", "to_k", "to_v", "to_out.0"],
    # both streams' attention: x (to_q/k/v, to_out.0) and context (add_q/k/v_proj, to_add_out); not attn2
    "attention_all": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out"],
    # every Linear of the joint blocks (adaLN modulations included), whole fused Linears
    "all_linear": ["joint_blocks.*"],
}

# kohya metadata of an SD3 LoRA (sd-scripts' networks/lora_sd3.py), for save_adapters(..., metadata=...)
KOHYA_METADATA = {"ss_network_module": "networks.lora_sd3"}
