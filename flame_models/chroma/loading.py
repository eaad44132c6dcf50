"""Load and save Chroma transformers: Chroma's single files (lodestones' names, also `model.diffusion_model.`-
prefixed as ComfyUI writes them) and diffusers files or folders (ChromaTransformer2DModel, sharded with their index
JSON), one tensor at a time into a model built under `flame_nn.empty_init`."""
from .. import checkpoint_io as CIO
from ..bfl.checkpoint import SHAPE_FIELDS, BflCheckpoint, diffusers_config, params_from_diffusers_config, save_layout
from . import keys as K
from .params import ChromaParams, configs

PARAMS_METADATA_KEY = "flame.chroma_params"


class ChromaCheckpointError(CIO.CheckpointError, RuntimeError):
    """A Chroma checkpoint with missing, unexpected or misshaped tensors, or an unreadable layout."""


class _Checkpoint(BflCheckpoint):
    error = ChromaCheckpointError
    what = "Chroma"
    key_layout = K
    params_class = ChromaParams
    metadata_key = PARAMS_METADATA_KEY


checkpoint_files = _Checkpoint.checkpoint_files


# what each field is read from: (Chroma key, diffusers key, dim)
_SHAPE_FIELDS = {**SHAPE_FIELDS,
                 "approximator_in_dim": ("distilled_guidance_layer.in_proj.weight",) * 2 + (1,),
                 "approximator_hidden_dim": ("distilled_guidance_layer.in_proj.weight",) * 2 + (0,)}


def infer_params(ckpt):
    """ChromaParams of a checkpoint: FLAME's metadata when save_chroma wrote it, else from the shapes (a head dim of
    128 means Flux's RoPE axes (16, 56, 56); other head dims must match a preset)."""
    p = ckpt.metadata_params()
    if p is not None:
        return p
    f = ckpt.shape_fields(_SHAPE_FIELDS)
    if ckpt.layout == "bfl":
        depth = ckpt.count("double_blocks.", ".img_attn.qkv.weight")
        single = ckpt.count("single_blocks.", ".linear1.weight")
        layers = ckpt.count("distilled_guidance_layer.layers.", ".in_layer.weight")
    else:
        depth = ckpt.count("transformer_blocks.", ".attn.to_q.weight")
        single = ckpt.count("single_transformer_blocks.", ".attn.to_q.weight")
        layers = ckpt.count("distilled_guidance_layer.layers.", ".linear_1.weight")
    H, D = f["hidden_size"], f["head_dim"]
    return ChromaParams(in_channels=f["in_channels"], out_channels=f["out_channels"],
                        context_in_dim=f["context_in_dim"], hidden_size=H, mlp_ratio=f["mlp_hidden"] / H,
                        num_heads=H // D, depth=depth, depth_single_blocks=single,
                        axes_dim=ckpt.rope_axes(H, D, configs), approximator_in_dim=f["approximator_in_dim"],
                        approximator_hidden_dim=f["approximator_hidden_dim"], approximator_layers=layers)


def read_chroma_params(path):
    """ChromaParams of a checkpoint (file, folder or index JSON) from its headers alone."""
    with _Checkpoint(path) as ckpt:
        return infer_params(ckpt)


def _plan(ckpt, params):
    return CIO.layout_plan(ckpt, params, native="bfl", native_shapes=K.bfl_shapes, plan=K.diffusers_plan)


def load_chroma_state_(model, path, *, strict=True):
    """Load a checkpoint into `model` (a Chroma), one tensor at a time; ChromaCheckpointError naming missing,
    unexpected and misshaped keys (in the file's names) before any tensor is read."""
    with _Checkpoint(path) as ckpt:
        return CIO.load_planned_(model, ckpt, _plan(ckpt, model.params), dict(model.named_parameters()),
                                 K.combine, what="Chroma", strict=strict)


def load_chroma(path, dtype=None, device=None, *, params=None, strict=True):
    """A Chroma model from a Chroma / ComfyUI single file or a diffusers file or folder, built under empty_init and
    filled one tensor at a time in `dtype` (default: the file's) on `device`. `params` overrides the inferred
    config."""
    from .model import Chroma
    model = CIO.empty_model(_Checkpoint, path, Chroma, infer=infer_params, params=params, dtype=dtype,
                            device=device, probes={"bfl": K.BFL_PROBE, "diffusers": K.BFL_PROBE})
    return load_chroma_state_(model, path, strict=strict)


def _diffusers_config(p):
    return diffusers_config("ChromaTransformer2DModel", p, axes_dims_rope=list(p.axes_dim),
                            approximator_num_channels=p.approximator_in_dim,
                            approximator_hidden_dim=p.approximator_hidden_dim,
                            approximator_layers=p.approximator_layers)


def chroma_params_from_config(config):
    """ChromaParams of a diffusers ChromaTransformer2DModel config (config.json's dict)."""
    return params_from_diffusers_config(ChromaParams, config, approximator_in_dim=config["approximator_num_channels"],
                                        approximator_hidden_dim=config["approximator_hidden_dim"],
                                        approximator_layers=config["approximator_layers"])


def save_chroma(model, path, layout="bfl", *, max_shard_size=None, dtype=None, metadata=None):
    """Save `model` in Chroma's own ("bfl") or diffusers ("diffusers") layout: a .safetensors path (or shards) or a
    folder (diffusers: diffusion_pytorch_model*.safetensors + config.json); dtype: the floating weights written in it
    (None: their own); metadata: more metadata entries. Returns the files written."""
    return save_layout(model, path, layout, to_diffusers=K.to_diffusers, metadata_key=PARAMS_METADATA_KEY,
                       stem="chroma", folder_config=_diffusers_config(model.params), max_shard_size=max_shard_size,
                       dtype=dtype, metadata=metadata)
