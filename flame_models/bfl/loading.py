"""Load and save Flux transformers: BFL single files (optionally `model.diffusion_model.`-prefixed) and diffusers
files or folders (sharded, with their index JSON). Loading reads one tensor at a time straight into the target
dtype and device, into a model built under `flame_nn.empty_init` (no random initialisation, no second copy)."""
from .. import checkpoint_io as CIO
from . import keys as K
from .checkpoint import SHAPE_FIELDS, BflCheckpoint, diffusers_config, params_from_diffusers_config, save_layout
from .params import FluxParams, configs

INDEX_SUFFIX = CIO.INDEX_SUFFIX
PARAMS_METADATA_KEY = "flame.flux_params"


class FluxCheckpointError(CIO.CheckpointError, RuntimeError):
    """A Flux checkpoint with missing, unexpected or misshaped tensors, or an unreadable layout."""


class _Checkpoint(BflCheckpoint):
    """Open safetensors handles of one Flux checkpoint; its keys (`index`, prefix stripped) and layout."""

    error = FluxCheckpointError
    what = "Flux"
    key_layout = K
    params_class = FluxParams
    metadata_key = PARAMS_METADATA_KEY


checkpoint_files = _Checkpoint.checkpoint_files


# ----------------------------------------------------------------------------- the config from the weights
# what each field is read from: (BFL key, diffusers key, dim)
_SHAPE_FIELDS = {**SHAPE_FIELDS,
                 "vec_in_dim": ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight", 1)}


def infer_params(ckpt):
    """FluxParams of a checkpoint: from FLAME's own metadata when saved by `save_flux`, else from the shapes.
    RoPE axes are not stored in the weights: a head dim of 128 means BFL's (16, 56, 56); other head dims must match
    a preset (or pass `params=` to load_flux)."""
    p = ckpt.metadata_params()
    if p is not None:
        return p
    f = ckpt.shape_fields(_SHAPE_FIELDS)
    if ckpt.layout == "bfl":
        depth = ckpt.count("double_blocks.", ".img_attn.qkv.weight")
        single = ckpt.count("single_blocks.", ".linear1.weight")
        guidance = "guidance_in.in_layer.weight" in ckpt.index
        qkv_bias = "double_blocks.0.img_attn.qkv.bias" in ckpt.index
    else:
        depth = ckpt.count("transformer_blocks.", ".attn.to_q.weight")
        single = ckpt.count("single_transformer_blocks.", ".attn.to_q.weight")
        guidance = "time_text_embed.guidance_embedder.linear_1.weight" in ckpt.index
        qkv_bias = "transformer_blocks.0.attn.to_q.bias" in ckpt.index
    H, D = f["hidden_size"], f["head_dim"]
    return FluxParams(in_channels=f["in_channels"], out_channels=f["out_channels"], vec_in_dim=f["vec_in_dim"],
                      context_in_dim=f["context_in_dim"], hidden_size=H, mlp_ratio=f["mlp_hidden"] / H,
                      num_heads=H // D, depth=depth, depth_single_blocks=single,
                      axes_dim=ckpt.rope_axes(H, D, configs), qkv_bias=qkv_bias, guidance_embed=guidance)


def read_flux_params(path):
    """FluxParams of a checkpoint (file, folder or index JSON) from its headers alone: no tensor is read."""
    with _Checkpoint(path) as ckpt:
        return infer_params(ckpt)


# ----------------------------------------------------------------------------- loading
def _plan(ckpt, params):
    return CIO.layout_plan(ckpt, params, native="bfl", native_shapes=K.bfl_shapes, plan=K.diffusers_plan)


def load_flux_state_(model, path, *, strict=True):
    """Load a checkpoint file/folder into `model` (a Flux, possibly built under empty_init), one tensor at a time,
    each converted to its parameter's dtype and device. Raises FluxCheckpointError naming missing, unexpected and
    misshaped keys (in the file's own names) before reading any tensor."""
    with _Checkpoint(path) as ckpt:
        return CIO.load_planned_(model, ckpt, _plan(ckpt, model.params), dict(model.named_parameters()),
                                 K.combine, what="Flux", strict=strict)


def load_flux(path, dtype=None, device=None, *, params=None, strict=True):
    """A Flux model from a BFL or diffusers checkpoint (file, folder or index JSON), built under empty_init and
    filled one tensor at a time, each converted to `dtype` (default: the dtype stored in the file) on `device`
    (default: the default device). `params` overrides the config inferred from the checkpoint."""
    from .model import Flux
    model = CIO.empty_model(_Checkpoint, path, Flux, infer=infer_params, params=params, dtype=dtype, device=device,
                            probes={"bfl": K.BFL_PROBE, "diffusers": K.DIFFUSERS_PROBE})
    return load_flux_state_(model, path, strict=strict)


# ----------------------------------------------------------------------------- saving
def _diffusers_config(p):
    return diffusers_config("FluxTransformer2DModel", p, pooled_projection_dim=p.vec_in_dim,
                            guidance_embeds=p.guidance_embed, axes_dims_rope=list(p.axes_dim))


def flux_params_from_config(config):
    """FluxParams of a diffusers FluxTransformer2DModel config (config.json's dict)."""
    return params_from_diffusers_config(FluxParams, config, vec_in_dim=config["pooled_projection_dim"],
                                        guidance_embed=config["guidance_embeds"])


def save_flux(model, path, layout="bfl", *, max_shard_size=None, dtype=None, metadata=None):
    """Save `model` in BFL ("bfl") or diffusers ("diffusers") layout. `path` ending in .safetensors: one file (or
    shards `<stem>-0000i-of-0000n.safetensors` plus `<path>.index.json` with max_shard_size bytes). Otherwise a folder
    (diffusers: diffusion_pytorch_model*.safetensors + config.json; bfl: flux*.safetensors). Returns the files
    written. dtype: the floating weights written in it (None: their own); metadata: more metadata entries."""
    return save_layout(model, path, layout, to_diffusers=K.bfl_to_diffusers, metadata_key=PARAMS_METADATA_KEY,
                       stem="flux", folder_config=_diffusers_config(model.params), max_shard_size=max_shard_size,
                       dtype=dtype, metadata=metadata)
