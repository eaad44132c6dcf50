"""Checkpoint layouts of Chroma: its own (BFL-style) key names and shapes, and the plan to and from diffusers'
ChromaTransformer2DModel names (the block tensors as Flux's, flame_models.bfl.keys; the approximator's
`layers.{l}.in_layer / out_layer` and `norms.{l}.scale` are diffusers' `linear_1 / linear_2` and `norms.{l}.weight`).
"""
from ..bfl.keys import bfl_to_diffusers_key
from ..checkpoint_io.plans import combine, join_by_plan, split_by_plan  # noqa: F401
from .params import chroma_params

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
BFL_PROBE = "distilled_guidance_layer.in_proj.weight"     # both layouts have it; the blocks tell them apart
BFL_BLOCK = "double_blocks.0.img_attn.qkv.weight"
DIFFUSERS_BLOCK = "transformer_blocks.0.attn.to_q.weight"


def bfl_shapes(params):
    """{Chroma key: shape} of every tensor of a Chroma model with these params, in module order."""
    p = chroma_params(params)
    H, M, D, A = p.hidden_size, p.mlp_hidden_dim, p.head_dim, p.approximator_hidden_dim
    shapes = {}

    def linear(name, n_in, n_out):
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    linear("img_in", p.in_channels, H)
    linear("txt_in", p.context_in_dim, H)
    g = "distilled_guidance_layer"
    linear(f"{g}.in_proj", p.approximator_in_dim, A)
    for l in range(p.approximator_layers):  # noqa: E741
        linear(f"{g}.layers.{l}.in_layer", A, A)
        linear(f"{g}.layers.{l}.out_layer", A, A)
    for l in range(p.approximator_layers):  # noqa: E741
        shapes[f"{g}.norms.{l}.scale"] = (A,)
    linear(f"{g}.out_proj", A, H)
    for i in range(p.depth):
        b = f"double_blocks.{i}"
        for s in ("img", "txt"):
            linear(f"{b}.{s}_attn.qkv", H, 3 * H)
            shapes[f"{b}.{s}_attn.norm.query_norm.scale"] = (D,)
            shapes[f"{b}.{s}_attn.norm.key_norm.scale"] = (D,)
            linear(f"{b}.{s}_attn.proj", H, H)
            linear(f"{b}.{s}_mlp.0", H, M)
            linear(f"{b}.{s}_mlp.2", M, H)
    for i in range(p.depth_single_blocks):
        b = f"single_blocks.{i}"
        linear(f"{b}.linear1", H, 3 * H + M)
        linear(f"{b}.linear2", H + M, H)
        shapes[f"{b}.norm.query_norm.scale"] = (D,)
        shapes[f"{b}.norm.key_norm.scale"] = (D,)
    linear("final_layer.linear", H, p.out_channels)
    return shapes


def to_diffusers_key(key):
    """(diffusers keys, how) for one Chroma key; how is "copy" or "cat". KeyError for an unknown key."""
    g = "distilled_guidance_layer."
    if key.startswith(g):
        rest = key[len(g):]
        parts = rest.split(".")
        if parts[0] == "layers" and len(parts) == 4:
            leaf = {"in_layer": "linear_1", "out_layer": "linear_2"}[parts[2]]
            return (f"{g}layers.{parts[1]}.{leaf}.{parts[3]}",), "copy"
        if parts[0] == "norms" and len(parts) == 3 and parts[2] == "scale":
            return (f"{g}norms.{parts[1]}.weight",), "copy"
        if parts[0] in ("in_proj", "out_proj") and len(parts) == 2:
            return (key,), "copy"
        raise KeyError(f"no diffusers name for the Chroma key {key!r}")
    return bfl_to_diffusers_key(key)


def diffusers_plan(params):
    """{Chroma key: (diffusers keys, how, row sizes)} for every tensor of a model with these params."""
    p = chroma_params(params)
    H, M = p.hidden_size, p.mlp_hidden_dim
    plan = {}
    for key, shape in bfl_shapes(p).items():
        dkeys, how = to_diffusers_key(key)
        sizes = ((H, H, H) if len(dkeys) == 3 else (H, H, H, M)) if how == "cat" else (shape[0],)
        plan[key] = (dkeys, how, sizes)
    return plan


def strip_prefix(keys):
    """(prefix, stripped keys): a ComfyUI `model.diffusion_model.` / `diffusion_model.` or a `transformer.` prefix
    shared by the keys of the transformer (other keys, such as a VAE's in a full checkpoint, are dropped)."""
    keys = list(keys)
    if BFL_PROBE in keys:
        return "", keys
    for prefix in PREFIXES:
        if prefix + BFL_PROBE in keys:
            return prefix, [k[len(prefix):] for k in keys if k.startswith(prefix)]
    return "", keys


def detect_layout(keys):
    """'bfl' (Chroma's own names) or 'diffusers' from the (prefix-stripped) key names."""
    keys = set(keys)
    if BFL_PROBE not in keys:
        sample = ", ".join(sorted(keys)[:5])
        raise KeyError(f"not a Chroma transformer checkpoint: no {BFL_PROBE!r} (the approximator); {len(keys)} "
                       f"keys, e.g. {sample}")
    if BFL_BLOCK in keys:
        return "bfl"
    if DIFFUSERS_BLOCK in keys:
        return "diffusers"
    raise KeyError(f"a Chroma approximator without blocks: neither {BFL_BLOCK!r} nor {DIFFUSERS_BLOCK!r}")


def to_diffusers(state, params):
    """A diffusers-layout state dict from a Chroma-layout one (Tensors)."""
    return split_by_plan(state, diffusers_plan(params))


def from_diffusers(state, params):
    """A Chroma-layout state dict from a diffusers-layout one (Tensors)."""
    return join_by_plan(state, diffusers_plan(params))
