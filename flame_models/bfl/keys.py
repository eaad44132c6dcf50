"""Checkpoint layouts of Flux: BFL's key names and shapes, and the conversion plan to and from diffusers' names.

A plan maps each BFL key to (diffusers keys, how): "copy" (one tensor, same values), "cat" (BFL rows are the
diffusers tensors concatenated along dim 0: qkv = to_q|to_k|to_v, single linear1 = q|k|v|proj_mlp) or "swap"
(final adaLN: BFL chunks (shift, scale), diffusers (scale, shift), so the two halves of dim 0 trade places).
"""

from ..checkpoint_io.plans import combine, join_by_plan, separate, split_by_plan  # noqa: F401
from .params import flux_params

BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
DIFFUSERS_PREFIXES = ("transformer.",)
BFL_PROBE = "double_blocks.0.img_attn.qkv.weight"
DIFFUSERS_PROBE = "transformer_blocks.0.attn.to_q.weight"


def linear_shapes(shapes, name, n_in, n_out):
    """Add a Linear's weight and bias shapes to `shapes` (BFL's names)."""
    shapes[f"{name}.weight"] = (n_out, n_in)
    shapes[f"{name}.bias"] = (n_out,)


def add_block_shapes(shapes, p, *, modulation=True, qkv_bias=True):
    """Add the double and single blocks' {BFL key: shape} of a Flux-derived model with params `p` to `shapes`, in
    module order: Flux's blocks carry their modulation Linears; Chroma's (`modulation=False`) take theirs from the
    approximator."""
    H, M, D = p.hidden_size, p.mlp_hidden_dim, p.head_dim
    for i in range(p.depth):
        b = f"double_blocks.{i}"
        for s in ("img", "txt"):
            if modulation:
                linear_shapes(shapes, f"{b}.{s}_mod.lin", H, 6 * H)
            shapes[f"{b}.{s}_attn.qkv.weight"] = (3 * H, H)
            if qkv_bias:
                shapes[f"{b}.{s}_attn.qkv.bias"] = (3 * H,)
            shapes[f"{b}.{s}_attn.norm.query_norm.scale"] = (D,)
            shapes[f"{b}.{s}_attn.norm.key_norm.scale"] = (D,)
            linear_shapes(shapes, f"{b}.{s}_attn.proj", H, H)
            linear_shapes(shapes, f"{b}.{s}_mlp.0", H, M)
            linear_shapes(shapes, f"{b}.{s}_mlp.2", M, H)
    for i in range(p.depth_single_blocks):
        b = f"single_blocks.{i}"
        linear_shapes(shapes, f"{b}.linear1", H, 3 * H + M)
        linear_shapes(shapes, f"{b}.linear2", H + M, H)
        shapes[f"{b}.norm.query_norm.scale"] = (D,)
        shapes[f"{b}.norm.key_norm.scale"] = (D,)
        if modulation:
            linear_shapes(shapes, f"{b}.modulation.lin", H, 3 * H)
    return shapes


def bfl_shapes(params):
    """{BFL key: shape} of every tensor of a Flux model with these params, in module order."""
    p = flux_params(params)
    H = p.hidden_size
    shapes = {}

    def mlp_embedder(name, n_in):
        linear_shapes(shapes, f"{name}.in_layer", n_in, H)
        linear_shapes(shapes, f"{name}.out_layer", H, H)

    linear_shapes(shapes, "img_in", p.in_channels, H)
    mlp_embedder("time_in", 256)
    mlp_embedder("vector_in", p.vec_in_dim)
    if p.guidance_embed:
        mlp_embedder("guidance_in", 256)
    linear_shapes(shapes, "txt_in", p.context_in_dim, H)
    add_block_shapes(shapes, p, qkv_bias=p.qkv_bias)
    linear_shapes(shapes, "final_layer.linear", H, p.out_channels)
    linear_shapes(shapes, "final_layer.adaLN_modulation.1", H, 2 * H)
    return shapes


# BFL module -> diffusers module, for modules whose weight and bias map one to one
_TOP = {
    "img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
}
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
_DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear"}
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}
_SINGLE_CAT = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _module_and_leaf(key):
    module, _, leaf = key.rpartition(".")
    return module, leaf


def bfl_to_diffusers_key(key):
    """(diffusers keys, how) for one BFL key; how is "copy", "cat" or "swap". KeyError for an unknown key."""
    if key.startswith("final_layer.adaLN_modulation.1."):
        return ("norm_out.linear." + key.rsplit(".", 1)[1],), "swap"
    module, leaf = _module_and_leaf(key)
    if module in _TOP:
        return (f"{_TOP[module]}.{leaf}",), "copy"
    parts = key.split(".")
    if len(parts) > 2 and parts[1].isdigit() and parts[0] in ("double_blocks", "single_blocks"):
        i, rest = parts[1], ".".join(parts[2:])
        rest_module, rest_leaf = _module_and_leaf(rest)
        if parts[0] == "double_blocks":
            b = f"transformer_blocks.{i}"
            if rest in _DOUBLE_NORMS:
                return (f"{b}.{_DOUBLE_NORMS[rest]}",), "copy"
            if rest_module in _DOUBLE:
                return (f"{b}.{_DOUBLE[rest_module]}.{rest_leaf}",), "copy"
            if rest_module in _DOUBLE_QKV:
                return tuple(f"{b}.{m}.{rest_leaf}" for m in _DOUBLE_QKV[rest_module]), "cat"
        else:
            b = f"single_transformer_blocks.{i}"
            if rest in _SINGLE_NORMS:
                return (f"{b}.{_SINGLE_NORMS[rest]}",), "copy"
            if rest_module in _SINGLE:
                return (f"{b}.{_SINGLE[rest_module]}.{rest_leaf}",), "copy"
            if rest_module == "linear1":
                return tuple(f"{b}.{m}.{rest_leaf}" for m in _SINGLE_CAT), "cat"
    raise KeyError(f"no diffusers name for the Flux (BFL) key {key!r}")


def diffusers_plan(params):
    """{BFL key: (diffusers keys, how, row sizes)} for every tensor of a model with these params.
    Row sizes are the dim-0 lengths of the diffusers pieces (what a "cat" splits into when saving)."""
    p = flux_params(params)
    return plan_of(bfl_shapes(p), bfl_to_diffusers_key, p)


def plan_of(shapes, to_diffusers_key, p):
    """The diffusers plan of a Flux-derived model's {BFL key: shape}: `to_diffusers_key(key)` -> (diffusers keys,
    how); a "cat" of three is a fused qkv (H rows each), of four a single block's linear1 (q | k | v | mlp)."""
    H, M = p.hidden_size, p.mlp_hidden_dim
    plan = {}
    for key, shape in shapes.items():
        dkeys, how = to_diffusers_key(key)
        sizes = ((H, H, H) if len(dkeys) == 3 else (H, H, H, M)) if how == "cat" else (shape[0],)
        if sum(sizes) != shape[0]:
            raise AssertionError(f"plan for {key}: pieces {sizes} do not add up to {shape}")
        plan[key] = (dkeys, how, sizes)
    return plan


def strip_prefix(keys):
    """(prefix, stripped keys): removes a ComfyUI `model.diffusion_model.` or a `transformer.` prefix shared by
    the keys that carry one (other keys, such as a VAE's in a full checkpoint, are dropped)."""
    keys = list(keys)
    for prefix in BFL_PREFIXES + DIFFUSERS_PREFIXES:
        if any(k.startswith(prefix) for k in keys) and not any(k in (BFL_PROBE, DIFFUSERS_PROBE) for k in keys):
            return prefix, [k[len(prefix):] for k in keys if k.startswith(prefix)]
    return "", keys


def detect_layout(keys):
    """'bfl' or 'diffusers' from the (prefix-stripped) key names."""
    keys = set(keys)
    if BFL_PROBE in keys:
        return "bfl"
    if DIFFUSERS_PROBE in keys:
        return "diffusers"
    sample = ", ".join(sorted(keys)[:5])
    raise KeyError(f"not a Flux transformer checkpoint: neither {BFL_PROBE!r} (BFL) nor {DIFFUSERS_PROBE!r} "
                   f"(diffusers) is present; {len(keys)} keys, e.g. {sample}")


# ----------------------------------------------------------------------------- tensor-level conversion
def bfl_to_diffusers(state, params):
    """A diffusers-layout state dict from a BFL-layout one (Tensors)."""
    return split_by_plan(state, diffusers_plan(params))


def diffusers_to_bfl(state, params):
    """A BFL-layout state dict from a diffusers-layout one (Tensors)."""
    return join_by_plan(state, diffusers_plan(params))
