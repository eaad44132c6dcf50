"""Checkpoint layouts of Chroma: its own (BFL-style) key names and shapes, and the plan to and from diffusers'
ChromaTransformer2DModel names (the block tensors as Flux's, flame_models.bfl.keys; the approximator's
`layers.{l}.in_layer / out_layer` and `norms.{l}.scale` are diffusers' `linear_1 / linear_2` and `norms.{l}.weight`).
"""
from ..bfl.keys import add_block_shapes, bfl_to_diffusers_key, linear_shapes, plan_of
from ..checkpoint_io.plans import combine, join_by_plan, split_by_plan  # noqa: F401
from .params import chroma_params

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
BFL_PROBE = "distilled_guidance_layer.in_proj.weight"     # both layouts have it; the blocks tell them apart
BFL_BLOCK = "double_blocks.0.img_attn.qkv.weight"
DIFFUSERS_BLOCK = "transformer_blocks.0.attn.to_q.weight"


def bfl_shapes(params):
    """{Chroma key: shape} of every tensor of a Chroma model with these params, in module order."""
    p = chroma_params(params)
    H, A = p.hidden_size, p.approximator_hidden_dim
    shapes = {}
    linear_shapes(shapes, "img_in", p.in_channels, H)
    linear_shapes(shapes, "txt_in", p.context_in_dim, H)
    g = "distilled_guidance_layer"
    linear_shapes(shapes, f"{g}.in_proj", p.approximator_in_dim, A)
    for l in range(p.approximator_layers):  # noqa: E741
        linear_shapes(shapes, f"{g}.layers.{l}.in_layer", A, A)
        linear_shapes(shapes, f"{g}.layers.{l}.out_layer", A, A)
    for l in range(p.approximator_layers):  # noqa: E741
        shapes[f"{g}.norms.{l}.scale"] = (A,)
    linear_shapes(shapes, f"{g}.out_proj", A, H)
    add_block_shapes(shapes, p, modulation=False)
    linear_shapes(shapes, "final_layer.linear", H, p.out_channels)
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
    return plan_of(bfl_shapes(p), to_diffusers_key, p)


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
