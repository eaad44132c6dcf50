"""Flux LoRA names: FLAME/BFL Linear names <-> diffusers (PEFT) names, with the fused-Linear row splits, and the
target presets.

FLAME's Flux follows the BFL checkpoint (fused img_attn.qkv, single-block linear1 = q|k|v|mlp). diffusers splits
those Linears, so one FLAME Linear maps to several diffusers Linears, each a range of its output rows
(docs/ARCHITECTURES.md). The final layer's adaLN is the one permutation: diffusers chunks it (scale, shift), BFL
(shift, scale).
"""
from flame_nn.adapters.formats import NameMap


def flux_name_map(depth=19, depth_single_blocks=38, hidden_size=3072, mlp_hidden=12288, guidance_embed=True,
                  out_channels=64):
    """NameMap for a Flux of the given size (defaults: flux-dev)."""
    H, M = hidden_size, mlp_hidden
    one = lambda name, n: [(name, [(0, n)])]  # noqa: E731
    t = {}
    for i in range(depth):
        d = f"transformer_blocks.{i}"
        b = f"double_blocks.{i}"
        t[f"{b}.img_attn.qkv"] = [(f"{d}.attn.to_q", [(0, H)]), (f"{d}.attn.to_k", [(H, 2 * H)]),
                                  (f"{d}.attn.to_v", [(2 * H, 3 * H)])]
        t[f"{b}.txt_attn.qkv"] = [(f"{d}.attn.add_q_proj", [(0, H)]), (f"{d}.attn.add_k_proj", [(H, 2 * H)]),
                                  (f"{d}.attn.add_v_proj", [(2 * H, 3 * H)])]
        t[f"{b}.img_attn.proj"] = one(f"{d}.attn.to_out.0", H)
        t[f"{b}.txt_attn.proj"] = one(f"{d}.attn.to_add_out", H)
        t[f"{b}.img_mlp.0"] = one(f"{d}.ff.net.0.proj", M)
        t[f"{b}.img_mlp.2"] = one(f"{d}.ff.net.2", H)
        t[f"{b}.txt_mlp.0"] = one(f"{d}.ff_context.net.0.proj", M)
        t[f"{b}.txt_mlp.2"] = one(f"{d}.ff_context.net.2", H)
        t[f"{b}.img_mod.lin"] = one(f"{d}.norm1.linear", 6 * H)
        t[f"{b}.txt_mod.lin"] = one(f"{d}.norm1_context.linear", 6 * H)
    for i in range(depth_single_blocks):
        s = f"single_transformer_blocks.{i}"
        b = f"single_blocks.{i}"
        t[f"{b}.linear1"] = [(f"{s}.attn.to_q", [(0, H)]), (f"{s}.attn.to_k", [(H, 2 * H)]),
                             (f"{s}.attn.to_v", [(2 * H, 3 * H)]), (f"{s}.proj_mlp", [(3 * H, 3 * H + M)])]
        t[f"{b}.linear2"] = one(f"{s}.proj_out", H)
        t[f"{b}.modulation.lin"] = one(f"{s}.norm.linear", 3 * H)
    t["img_in"] = one("x_embedder", H)
    t["txt_in"] = one("context_embedder", H)
    for bfl, dif in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder")) + (
            (("guidance_in", "guidance_embedder"),) if guidance_embed else ()):
        t[f"{bfl}.in_layer"] = one(f"time_text_embed.{dif}.linear_1", H)
        t[f"{bfl}.out_layer"] = one(f"time_text_embed.{dif}.linear_2", H)
    t["final_layer.linear"] = one("proj_out", out_channels)
    t["final_layer.adaLN_modulation.1"] = [("norm_out.linear", [(H, 2 * H), (0, H)])]
    return NameMap(t)


def name_map_for(config):
    """NameMap for a FluxParams-like config (attributes depth, depth_single_blocks, hidden_size, mlp_ratio,
    guidance_embed)."""
    H = config.hidden_size
    return flux_name_map(config.depth, config.depth_single_blocks, H, int(H * config.mlp_ratio),
                         getattr(config, "guidance_embed", True), getattr(config, "out_channels", 64))


# Target presets, as name patterns (see flame_nn.adapters.inject.matches). A pattern may name FLAME Linears or
# diffusers Linears; the latter become adapters on row ranges of the fused FLAME Linear.
TARGET_PRESETS = {
    # the peer's (and diffusers' train_dreambooth_lora_flux default) choice: to_q/to_k/to_v/to_out.0
    "attention": ["to_q", "to_k", "to_v", "to_out.0"],
    # both streams' attention in double blocks, q/k/v of single blocks
    "attention_all": ["double_blocks.*.img_attn.qkv", "double_blocks.*.txt_attn.qkv", "double_blocks.*.img_attn.proj",
                      "double_blocks.*.txt_attn.proj", "single_transformer_blocks.*.attn.to_q",
                      "single_transformer_blocks.*.attn.to_k", "single_transformer_blocks.*.attn.to_v"],
    # every Linear of the transformer blocks (kohya's default for Flux), whole fused Linears
    "all_linear": ["double_blocks.*", "single_blocks.*"],
}
