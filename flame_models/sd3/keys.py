"""Checkpoint layouts of the SD3 MMDiT: SAI's key names and shapes, and the conversion plan to and from diffusers'
SD3Transformer2DModel names (checked against diffusers' convert_sd3_transformer_checkpoint_to_diffusers).

A plan maps each SAI key to (diffusers keys, how): "copy", "cat" (SAI's fused qkv rows are to_q | to_k | to_v) or
"swap" (diffusers' AdaLayerNormContinuous chunks (scale, shift) where SAI chunks (shift, scale): the final layer's
adaLN and the last block's pre-only context adaLN have their two halves exchanged).
"""
# the tensor-level conversions are Flux's (combine and separate are used as sd3.keys' too)
from ..checkpoint_io.plans import combine, join_by_plan, separate, split_by_plan  # noqa: F401
from .params import sd3_params

SAI_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
DIFFUSERS_PREFIXES = ("transformer.",)
SAI_PROBE = "joint_blocks.0.x_block.attn.qkv.weight"
DIFFUSERS_PROBE = "transformer_blocks.0.attn.to_q.weight"
DIFFUSERS_SD3_MARK = "pos_embed.proj.weight"      # Flux's diffusers layout shares the probe above, not this


def sai_shapes(params):
    """{SAI key: shape} of every tensor (parameters and the pos_embed buffer) of a model with these params."""
    p = sd3_params(params)
    H, D, M, P = p.hidden_size, p.head_dim, p.mlp_hidden_dim, p.patch_size
    shapes = {"pos_embed": (1, p.pos_embed_max_size ** 2, H)}

    def linear(name, n_in, n_out):
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    def attention(name, pre_only):
        linear(f"{name}.qkv", H, 3 * H)
        if p.qk_norm:
            shapes[f"{name}.ln_q.weight"] = (D,)
            shapes[f"{name}.ln_k.weight"] = (D,)
        if not pre_only:
            linear(f"{name}.proj", H, H)

    shapes["x_embedder.proj.weight"] = (H, p.in_channels, P, P)
    shapes["x_embedder.proj.bias"] = (H,)
    for name, n_in in (("t_embedder", 256), ("y_embedder", p.pooled_in_dim)):
        linear(f"{name}.mlp.0", n_in, H)
        linear(f"{name}.mlp.2", H, H)
    linear("context_embedder", p.context_in_dim, H)
    for i in range(p.depth):
        for stream in ("context_block", "x_block"):
            b = f"joint_blocks.{i}.{stream}"
            pre_only = stream == "context_block" and i == p.depth - 1
            dual = stream == "x_block" and i in p.dual_attention_layers
            attention(f"{b}.attn", pre_only)
            if dual:
                attention(f"{b}.attn2", False)
            if not pre_only:
                linear(f"{b}.mlp.fc1", H, M)
                linear(f"{b}.mlp.fc2", M, H)
            linear(f"{b}.adaLN_modulation.1", H, (2 if pre_only else 9 if dual else 6) * H)
    linear("final_layer.linear", H, P * P * p.out_channels)
    linear("final_layer.adaLN_modulation.1", H, 2 * H)
    return shapes


# SAI module -> diffusers module, one to one
_TOP = {
    "x_embedder.proj": "pos_embed.proj", "context_embedder": "context_embedder", "final_layer.linear": "proj_out",
    "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
}
_X = {"attn.proj": "attn.to_out.0", "attn.ln_q": "attn.norm_q", "attn.ln_k": "attn.norm_k",
      "attn2.proj": "attn2.to_out.0", "attn2.ln_q": "attn2.norm_q", "attn2.ln_k": "attn2.norm_k",
      "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2", "adaLN_modulation.1": "norm1.linear"}
_CONTEXT = {"attn.proj": "attn.to_add_out", "attn.ln_q": "attn.norm_added_q", "attn.ln_k": "attn.norm_added_k",
            "mlp.fc1": "ff_context.net.0.proj", "mlp.fc2": "ff_context.net.2",
            "adaLN_modulation.1": "norm1_context.linear"}
_QKV = {("x_block", "attn.qkv"): ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("x_block", "attn2.qkv"): ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
        ("context_block", "attn.qkv"): ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def sai_to_diffusers_key(key, depth):
    """(diffusers keys, how) for one SAI key of a model with `depth` joint blocks; KeyError for an unknown key."""
    if key == "pos_embed":
        return ("pos_embed.pos_embed",), "copy"
    module, _, leaf = key.rpartition(".")
    if module == "final_layer.adaLN_modulation.1":
        return (f"norm_out.linear.{leaf}",), "swap"
    if module in _TOP:
        return (f"{_TOP[module]}.{leaf}",), "copy"
    parts = module.split(".")
    if len(parts) > 3 and parts[0] == "joint_blocks" and parts[1].isdigit() and parts[2] in ("x_block",
                                                                                               "context_block"):
        i, stream, rest = int(parts[1]), parts[2], ".".join(parts[3:])
        b = f"transformer_blocks.{i}"
        if (stream, rest) in _QKV:
            return tuple(f"{b}.{m}.{leaf}" for m in _QKV[(stream, rest)]), "cat"
        table = _X if stream == "x_block" else _CONTEXT
        if rest in table:
            last_context_mod = stream == "context_block" and rest == "adaLN_modulation.1" and i == depth - 1
            return (f"{b}.{table[rest]}.{leaf}",), ("swap" if last_context_mod else "copy")
    raise KeyError(f"no diffusers name for the SD3 (SAI) key {key!r}")


def diffusers_plan(params):
    """{SAI key: (diffusers keys, how, row sizes)} for every tensor of a model with these params; row sizes are the
    dim-0 lengths of the diffusers pieces (what a "cat" splits into when saving)."""
    p = sd3_params(params)
    plan = {}
    for key, shape in sai_shapes(p).items():
        dkeys, how = sai_to_diffusers_key(key, p.depth)
        sizes = (p.hidden_size,) * 3 if how == "cat" else (shape[0],)
        if sum(sizes) != shape[0]:
            raise AssertionError(f"plan for {key}: pieces {sizes} do not add up to {shape}")
        plan[key] = (dkeys, how, sizes)
    return plan


def sai_to_diffusers(state, params):
    """A diffusers-layout state dict from an SAI-layout one (Tensors)."""
    return split_by_plan(state, diffusers_plan(params))


def diffusers_to_sai(state, params):
    """An SAI-layout state dict from a diffusers-layout one (Tensors)."""
    return join_by_plan(state, diffusers_plan(params))


def strip_prefix(keys):
    """(prefix, stripped keys): removes SAI's `model.diffusion_model.` (or `diffusion_model.`, `transformer.`) from
    the keys that carry it; the others (a VAE's `first_stage_model.*`, `text_encoders.*` in a full SAI file) are
    dropped."""
    keys = list(keys)
    if SAI_PROBE in keys or DIFFUSERS_PROBE in keys:
        return "", keys
    for prefix in SAI_PREFIXES + DIFFUSERS_PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            return prefix, [k[len(prefix):] for k in keys if k.startswith(prefix)]
    return "", keys


def detect_layout(keys, where="checkpoint"):
    """'sai' or 'diffusers' from the (prefix-stripped) key names; ValueError saying what the file looks like
    otherwise."""
    keys = set(keys)
    if SAI_PROBE in keys:
        return "sai"
    if DIFFUSERS_PROBE in keys and DIFFUSERS_SD3_MARK in keys:
        return "diffusers"
    raise ValueError(f"{where} is not an SD3 transformer ({describe(keys)}): neither {SAI_PROBE!r} (SAI) nor "
                     f"{DIFFUSERS_PROBE!r} with {DIFFUSERS_SD3_MARK!r} (diffusers) is present")


# what other checkpoints look like: (description, a key prefix or suffix that marks them)
_LOOKS_LIKE = (
    ("SD3 text encoders only", "text_encoders."),
    ("a VAE (in a full checkpoint)", "first_stage_model."),
    ("a Flux transformer (BFL layout)", "double_blocks."),
    ("a Flux transformer (diffusers layout)", "single_transformer_blocks."),
    ("an SDXL / SD1 UNet (LDM layout)", "input_blocks."),
    ("a UNet (diffusers layout)", "down_blocks."),
    ("a LoRA / adapter file", "lora_"),
    ("a LoRA / adapter file (PEFT)", ".lora_A."),
    ("a VAE", "decoder.conv_in."),
    ("a CLIP text encoder", "text_model."),
    ("a T5 encoder", "encoder.block."),
)


def describe(keys):
    """A one-line guess at what a checkpoint is, from its key names."""
    keys = list(keys)
    for what, mark in _LOOKS_LIKE:
        if any(k.startswith(mark) or mark in k for k in keys):
            return f"it looks like {what}; {len(keys)} tensors, e.g. {', '.join(sorted(keys)[:3])}"
    if not keys:
        return "it holds no tensors"
    return f"{len(keys)} tensors, e.g. {', '.join(sorted(keys)[:3])}"
