"""Load and save SD3 / SD3.5 transformers: SAI single files (`model.diffusion_model.`-prefixed, possibly holding the
VAE and text encoders too -- only the transformer is read here) and diffusers folders (`transformer/` with
config.json and sharded safetensors + index) or files. Loading reads one tensor at a time straight into the target
dtype and device, into a model built under `flame_nn.empty_init` (no random initialisation, no second copy)."""
import dataclasses
import json
import math
import os

import flame_core as flame

from .. import checkpoint_io as CIO
from . import keys as K
from .params import SD3Params

INDEX_SUFFIX = CIO.INDEX_SUFFIX
PARAMS_METADATA_KEY = "flame.sd3_params"
SAI_PREFIX = "model.diffusion_model."


class SD3CheckpointError(CIO.CheckpointError, ValueError):
    """An SD3 checkpoint with missing, unexpected or misshaped tensors, or a file that is not an SD3 transformer."""


# ----------------------------------------------------------------------------- finding the files
def checkpoint_files(path):
    """(safetensors files, diffusers config dict or None) of a checkpoint: a file, an index JSON, or a folder (a
    diffusers pipeline folder's `transformer/` too)."""
    files = CIO.safetensors_files(path, what="SD3", error=SD3CheckpointError, subfolder="transformer")
    return files, CIO.read_config_json(os.path.dirname(files[0]) or ".", SD3CheckpointError)


class _Checkpoint(CIO.SafetensorsCheckpoint):
    """Open safetensors handles of one checkpoint, its keys (`index`, prefix stripped), layout and diffusers
    config."""

    error = SD3CheckpointError

    def __init__(self, path):
        self.path = os.fspath(path)
        files, self.config = checkpoint_files(path)
        super().__init__(files, label=self.path)

    def scan_keys(self):
        self.prefix, self.index = K.strip_prefix(self.handle_of)
        try:
            self.layout = K.detect_layout(self.index, where=self.path)
        except ValueError as e:
            raise SD3CheckpointError(str(e)) from None

    def metadata_params(self):
        meta = self.metadata(PARAMS_METADATA_KEY)
        if meta is None:
            return None
        d = json.loads(meta)
        return SD3Params(**{**d, "dual_attention_layers": tuple(d.get("dual_attention_layers", ()))})


# ----------------------------------------------------------------------------- the config from the weights
# (SAI key, diffusers key) per field read from a shape: (field, keys, dim)
_SHAPE_FIELDS = (
    ("hidden_size", ("x_embedder.proj.weight", "pos_embed.proj.weight"), 0),
    ("in_channels", ("x_embedder.proj.weight", "pos_embed.proj.weight"), 1),
    ("patch_size", ("x_embedder.proj.weight", "pos_embed.proj.weight"), 2),
    ("table", ("pos_embed", "pos_embed.pos_embed"), 1),
    ("context_in_dim", ("context_embedder.weight", "context_embedder.weight"), 1),
    ("pooled_in_dim", ("y_embedder.mlp.0.weight", "time_text_embed.text_embedder.linear_1.weight"), 1),
    ("out_features", ("final_layer.linear.weight", "proj_out.weight"), 0),
)


def infer_params(ckpt):
    """SD3Params of a checkpoint: from FLAME's own metadata when saved by `save_sd3`, else from the shapes (the head
    dim from the QK-norm weights, a diffusers config.json, or SAI's convention of 64)."""
    p = ckpt.metadata_params()
    if p is not None:
        return p
    col = 0 if ckpt.layout == "sai" else 1
    try:
        f = {name: ckpt.shape(keys[col])[dim] for name, keys, dim in _SHAPE_FIELDS}
    except KeyError as e:
        raise SD3CheckpointError(f"{ckpt.path}: cannot infer the SD3 config, missing {e}") from None
    if ckpt.layout == "sai":
        depth = _count(ckpt.index, "joint_blocks.", ".x_block.attn.qkv.weight")
        dual = _indices(ckpt.index, "joint_blocks.", ".x_block.attn2.qkv.weight")
        qk_key = "joint_blocks.0.x_block.attn.ln_q.weight"
    else:
        depth = _count(ckpt.index, "transformer_blocks.", ".attn.to_q.weight")
        dual = _indices(ckpt.index, "transformer_blocks.", ".attn2.to_q.weight")
        qk_key = "transformer_blocks.0.attn.norm_q.weight"
    H, side = f["hidden_size"], math.isqrt(f["table"])
    if side * side != f["table"]:
        raise SD3CheckpointError(f"{ckpt.path}: the position table has {f['table']} rows, not a square grid")
    config = (ckpt.config or {}) if ckpt.layout == "diffusers" else {}
    if qk_key in ckpt.index:
        head_dim = ckpt.shape(qk_key)[0]
    elif "attention_head_dim" in config:
        head_dim = int(config["attention_head_dim"])
    elif H % 64 == 0:
        head_dim = 64  # every SD3 / SD3.5 release (SAI: hidden = 64 * depth, one head per block of depth)
    else:
        raise SD3CheckpointError(f"{ckpt.path}: hidden size {H} is not a multiple of 64 and the file has neither "
                                 f"QK-norm weights nor a config.json to give the head dim; pass params=SD3Params(...)")
    return SD3Params(in_channels=f["in_channels"], out_channels=f["out_features"] // f["patch_size"] ** 2,
                     patch_size=f["patch_size"], hidden_size=H, num_heads=H // head_dim, depth=depth,
                     context_in_dim=f["context_in_dim"], pooled_in_dim=f["pooled_in_dim"], pos_embed_max_size=side,
                     dual_attention_layers=dual, qk_norm="rms" if qk_key in ckpt.index else None,
                     sample_size=int(config.get("sample_size", SD3Params.sample_size)))


def _indices(keys, prefix, suffix):
    return CIO.block_indices(keys, prefix, suffix)


def _count(keys, prefix, suffix):
    return len(_indices(keys, prefix, suffix))


# ----------------------------------------------------------------------------- loading
def _plan(ckpt, params):
    return CIO.layout_plan(ckpt, params, native="sai", native_shapes=K.sai_shapes, plan=K.diffusers_plan)


def _model_tensors(model):
    """Parameters and the pos_embed buffer, in state_dict (= SAI key) order."""
    return dict(model.state_dict(keep_vars=True))


def load_sd3_state_(model, path, *, strict=True):
    """Load a checkpoint file/folder into `model` (an MMDiT, possibly built under empty_init), one tensor at a time,
    each converted to its parameter's dtype and device. Raises SD3CheckpointError naming missing, unexpected and
    misshaped keys (in the file's own names) before reading any tensor."""
    with _Checkpoint(path) as ckpt:
        return CIO.load_planned_(model, ckpt, _plan(ckpt, model.params), _model_tensors(model), K.combine,
                                 what="SD3", strict=strict)


def load_sd3(path, dtype=None, device=None, *, params=None, strict=True):
    """An MMDiT from an SAI or diffusers checkpoint (file, folder or index JSON), built under empty_init and filled
    one tensor at a time, each converted to `dtype` (default: the dtype stored in the file) on `device` (default: the
    default device). `params` overrides the config inferred from the checkpoint. In an SAI file holding the VAE and
    text encoders too, only the `model.diffusion_model.` tensors are read."""
    from .model import MMDiT
    model = CIO.empty_model(_Checkpoint, path, MMDiT, infer=infer_params, params=params, dtype=dtype, device=device,
                            probes={"sai": K.SAI_PROBE, "diffusers": K.DIFFUSERS_PROBE})
    return load_sd3_state_(model, path, strict=strict)


# ----------------------------------------------------------------------------- saving
def diffusers_config(p):
    """config.json of diffusers' SD3Transformer2DModel for these params."""
    return {"_class_name": "SD3Transformer2DModel", "sample_size": p.sample_size, "patch_size": p.patch_size,
            "in_channels": p.in_channels, "num_layers": p.depth, "attention_head_dim": p.head_dim,
            "num_attention_heads": p.num_heads, "joint_attention_dim": p.context_in_dim,
            "caption_projection_dim": p.hidden_size, "pooled_projection_dim": p.pooled_in_dim,
            "out_channels": p.out_channels, "pos_embed_max_size": p.pos_embed_max_size,
            "dual_attention_layers": list(p.dual_attention_layers),
            "qk_norm": "rms_norm" if p.qk_norm == "rms" else None}


def save_sd3(model, path, layout="sai", *, max_shard_size=None, prefix=None, dtype=None, metadata=None):
    """Save `model` in SAI ("sai") or diffusers ("diffusers") layout; every file is written to a temp file and
    renamed. `path` ending in .safetensors: one file (or shards `<stem>-0000i-of-0000n.safetensors` plus
    `<path>.index.json` with max_shard_size bytes). Otherwise a folder (diffusers: diffusion_pytorch_model*.safetensors
    + config.json; sai: sd3*.safetensors). SAI keys carry `prefix`, default `model.diffusion_model.` as SAI's own
    files (pass "" for a bare transformer file); dtype: the floating weights written in it (None: their own);
    metadata: more metadata entries. Returns the files written."""
    if layout not in ("sai", "diffusers"):
        raise ValueError(f"layout must be 'sai' or 'diffusers', got {layout!r}")
    if prefix is not None and layout != "sai":
        raise ValueError("prefix applies to the SAI layout only (diffusers keys have none)")
    CIO.check_saveable(model, "save_sd3")
    p = model.params
    with flame.no_grad():
        state = {k: t.detach() for k, t in _model_tensors(model).items()}
        if layout == "diffusers":
            state = K.sai_to_diffusers(state, p)
        else:
            pre = SAI_PREFIX if prefix is None else prefix
            state = {pre + k: t for k, t in state.items()}
    metadata = {**(metadata or {}), "format": "pt", PARAMS_METADATA_KEY: json.dumps(dataclasses.asdict(p))}
    diffusers = layout == "diffusers"
    return CIO.save_weights(state.items(), path, stem="diffusion_pytorch_model" if diffusers else "sd3",
                            metadata=metadata, max_shard_size=max_shard_size,
                            folder_config=diffusers_config(p) if diffusers else None, dtype=dtype)
