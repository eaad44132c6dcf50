"""Checkpoint keys of Qwen-Image's transformer. The Qwen release, diffusers' QwenImageTransformer2DModel and ComfyUI
share one set of names (ComfyUI's files put them under `model.diffusion_model.` or `diffusion_model.`), so loading is
a copy per tensor once the prefix is stripped; FLAME's modules carry those names."""
from .params import qwen_image_params

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
PROBE = "txt_norm.weight"                          # only Qwen-Image's transformer has it (ComfyUI detects it so)
BLOCK_PROBE = "transformer_blocks.0.img_mod.1.weight"


def qwen_image_shapes(params):
    """{key: shape} of every tensor of a Qwen-Image transformer with these params, in module order."""
    p = qwen_image_params(params)
    D, J, M, hd = p.hidden_size, p.joint_attention_dim, p.mlp_hidden_dim, p.attention_head_dim
    shapes = {}

    def linear(name, n_in, n_out):
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    linear("time_text_embed.timestep_embedder.linear_1", 256, D)
    linear("time_text_embed.timestep_embedder.linear_2", D, D)
    shapes["txt_norm.weight"] = (J,)
    linear("img_in", p.in_channels, D)
    linear("txt_in", J, D)
    for i in range(p.num_layers):
        b = f"transformer_blocks.{i}"
        linear(f"{b}.img_mod.1", D, 6 * D)
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            linear(f"{b}.attn.{name}", D, D)
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[f"{b}.attn.{name}.weight"] = (hd,)
        linear(f"{b}.attn.to_out.0", D, D)
        linear(f"{b}.attn.to_add_out", D, D)
        linear(f"{b}.img_mlp.net.0.proj", D, M)
        linear(f"{b}.img_mlp.net.2", M, D)
        linear(f"{b}.txt_mod.1", D, 6 * D)
        linear(f"{b}.txt_mlp.net.0.proj", D, M)
        linear(f"{b}.txt_mlp.net.2", M, D)
    linear("norm_out.linear", D, 2 * D)
    linear("proj_out", D, p.proj_out_dim)
    return shapes


def strip_prefix(keys):
    """(prefix, stripped keys) of the transformer's tensors: ComfyUI's `model.diffusion_model.` / `diffusion_model.`
    or a `transformer.` prefix, or none (keys of other models in the same file are dropped)."""
    keys = list(keys)
    if PROBE in keys:
        return "", keys
    for prefix in PREFIXES:
        if prefix + PROBE in keys:
            return prefix, [k[len(prefix):] for k in keys if k.startswith(prefix)]
    return "", keys
