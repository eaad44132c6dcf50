"""Load and save SD3 / SD3.5 transformers: SAI single files (`model.diffusion_model.`-prefixed, possibly holding the
VAE and text encoders too -- only the transformer is read here) and diffusers folders (`transformer/` with
config.json and sharded safetensors + index) or files. Loading reads one tensor at a time straight into the target
dtype and device, into a model built under `flame_nn.empty_init` (no random initialisation, no second copy)."""
import json
import math
import os

import flame_core as flame
import flame_nn
from flame_core.dtypes import dtype_of
from flame_core.errors import FlameError
from flame_core.io import safe_open, save_file

from ..flux.loading import _shards
from . import keys as K
from .params import SD3Params

INDEX_SUFFIX = ".safetensors.index.json"
PARAMS_METADATA_KEY = "flame.sd3_params"
SAI_PREFIX = "model.diffusion_model."


class SD3CheckpointError(FlameError, ValueError):
    """An SD3 checkpoint with missing, unexpected or misshaped tensors, or a file that is not an SD3 transformer."""


# ----------------------------------------------------------------------------- finding the files
def checkpoint_files(path):
    """(safetensors files, diffusers config dict or None) of a checkpoint: a file, an index JSON, or a folder (a
    diffusers pipeline folder's `transformer/` too)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        sub = os.path.join(path, "transformer")
        if os.path.isdir(sub) and not any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in os.listdir(path)):
            return checkpoint_files(sub)
        config = _read_config(os.path.join(path, "config.json"))
        indexes = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
        if len(indexes) > 1:
            raise SD3CheckpointError(f"{path}: several index files ({', '.join(indexes)}); pass one of them")
        if indexes:
            return checkpoint_files(os.path.join(path, indexes[0]))[0], config
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if len(files) != 1:
            raise SD3CheckpointError(f"{path}: expected one .safetensors file or an index JSON, found {len(files)} "
                                     f"safetensors files ({', '.join(files[:5])})")
        return [os.path.join(path, files[0])], config
    if not os.path.exists(path):
        raise FileNotFoundError(f"no SD3 checkpoint at {path}")
    folder = os.path.dirname(path)
    config = _read_config(os.path.join(folder, "config.json"))
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise SD3CheckpointError(f"{path}: not a readable safetensors index JSON ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SD3CheckpointError(f"{path}: an index JSON needs a non-empty 'weight_map'")
        files = [os.path.join(folder, n) for n in dict.fromkeys(weight_map.values())]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise SD3CheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(absent)}")
        return files, config
    return [path], config


def _read_config(path):
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SD3CheckpointError(f"{path}: unreadable config.json ({e})") from None
    return config if isinstance(config, dict) else None


class _Checkpoint:
    """Open safetensors handles of one checkpoint, its key index (prefix stripped), layout and diffusers config."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files, self.config = checkpoint_files(path)
        self.handles = []
        try:
            raw = {}
            for f in self.files:
                h = safe_open(f)
                self.handles.append(h)
                for k in h.keys():
                    if k in raw:
                        raise SD3CheckpointError(f"{self.path}: tensor {k!r} appears in two files, "
                                                 f"{raw[k].filename} and {h.filename}")
                    raw[k] = h
            self.prefix, stripped = K.strip_prefix(raw)
            self.index = {k: raw[self.prefix + k] for k in stripped}
            try:
                self.layout = K.detect_layout(self.index, where=self.path)
            except ValueError as e:
                raise SD3CheckpointError(str(e)) from None
        except BaseException:
            self.close()
            raise

    def shape(self, key):
        return tuple(self.index[key].shape(self.prefix + key))

    def dtype(self, key):
        return dtype_of(self.index[key].dtype(self.prefix + key))

    def get(self, key, dtype, device):
        return self.index[key].get_tensor(self.prefix + key, dtype=dtype, device=device)

    def metadata_params(self):
        for h in self.handles:
            meta = h.metadata() or {}
            if PARAMS_METADATA_KEY in meta:
                d = json.loads(meta[PARAMS_METADATA_KEY])
                return SD3Params(**{**d, "dual_attention_layers": tuple(d.get("dual_attention_layers", ()))})
        return None

    def close(self):
        for h in self.handles:
            h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


def _indices(index, prefix, suffix):
    return tuple(sorted(int(k[len(prefix):-len(suffix)]) for k in index if k.startswith(prefix)
                        and k.endswith(suffix) and k[len(prefix):-len(suffix)].isdigit()))


def _count(index, prefix, suffix):
    return len(_indices(index, prefix, suffix))


# ----------------------------------------------------------------------------- loading
def _sources(ckpt, params):
    """{SAI key: (file keys, how)} for the checkpoint's layout."""
    if ckpt.layout == "sai":
        return {k: ((k,), "copy") for k in K.sai_shapes(params)}
    return {k: (dkeys, how) for k, (dkeys, how, _) in K.diffusers_plan(params).items()}


def _source_shape(ckpt, dkeys, how):
    shapes = [ckpt.shape(k) for k in dkeys]
    if how != "cat":
        return shapes[0]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        return tuple(shapes)  # pieces that cannot be concatenated: reported as they are
    return (sum(s[0] for s in shapes),) + shapes[0][1:]


def _model_tensors(model):
    """Parameters and the pos_embed buffer, in state_dict (= SAI key) order."""
    return dict(model.state_dict(keep_vars=True))


def load_sd3_state_(model, path, *, strict=True):
    """Load a checkpoint file/folder into `model` (an MMDiT, possibly built under empty_init), one tensor at a time,
    each converted to its parameter's dtype and device. Raises SD3CheckpointError naming missing, unexpected and
    misshaped keys (in the file's own names) before reading any tensor."""
    targets = _model_tensors(model)
    with _Checkpoint(path) as ckpt:
        sources = _sources(ckpt, model.params)
        unknown = sorted(set(sources) ^ set(targets))
        if unknown:
            raise SD3CheckpointError(f"model and plan disagree on {unknown[:10]}: is this a flame_models MMDiT?")
        used = {k for dkeys, _ in sources.values() for k in dkeys}
        missing = [k for dkeys, _ in sources.values() for k in dkeys if k not in ckpt.index]
        unexpected = [k for k in ckpt.index if k not in used]
        misshaped = []
        for key, (dkeys, how) in sources.items():
            if all(k in ckpt.index for k in dkeys):
                got, want = _source_shape(ckpt, dkeys, how), tuple(targets[key].shape)
                if got != want:
                    misshaped.append(f"{'+'.join(dkeys)}: {got} in the file, {want} in the model ({key})")
        if misshaped or (strict and (missing or unexpected)):
            raise SD3CheckpointError(_load_error(ckpt, missing, unexpected, misshaped))
        loaded = {}
        with flame.no_grad():
            for key, (dkeys, how) in sources.items():
                if all(k in ckpt.index for k in dkeys):
                    t = targets[key]
                    pieces = [ckpt.get(k, dtype=t.dtype, device=t.device) for k in dkeys]
                    loaded[key] = K.combine(how, pieces).contiguous()
                    del pieces
    # assign=True: each converted tensor becomes the parameter's storage (no second copy of the model)
    model.load_state_dict(loaded, strict=False, assign=True)
    return model


def _load_error(ckpt, missing, unexpected, misshaped):
    def listing(xs):
        return ", ".join(xs[:20]) + (f", ... and {len(xs) - 20} more" if len(xs) > 20 else "")
    lines = [f"cannot load the SD3 checkpoint {ckpt.path} ({ckpt.layout} layout"
             + (f", prefix {ckpt.prefix!r}" if ckpt.prefix else "") + "):"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {listing(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {listing(unexpected)}")
    if misshaped:
        lines.append(f"  misshaped ({len(misshaped)}): " + "; ".join(misshaped[:20]))
    return "\n".join(lines)


def load_sd3(path, dtype=None, device=None, *, params=None, strict=True):
    """An MMDiT from an SAI or diffusers checkpoint (file, folder or index JSON), built under empty_init and filled
    one tensor at a time, each converted to `dtype` (default: the dtype stored in the file) on `device` (default: the
    default device). `params` overrides the config inferred from the checkpoint. In an SAI file holding the VAE and
    text encoders too, only the `model.diffusion_model.` tensors are read."""
    from .model import MMDiT
    with _Checkpoint(path) as ckpt:
        if params is None:
            params = infer_params(ckpt)
        if dtype is None:
            dtype = ckpt.dtype(K.SAI_PROBE if ckpt.layout == "sai" else K.DIFFUSERS_PROBE)
    with flame_nn.empty_init(device=device, dtype=dtype):
        model = MMDiT(params)
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


def _write_json(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_sd3(model, path, layout="sai", *, max_shard_size=None, prefix=None):
    """Save `model` in SAI ("sai") or diffusers ("diffusers") layout; every file is written to a temp file and
    renamed. `path` ending in .safetensors: one file (or shards `<stem>-0000i-of-0000n.safetensors` plus
    `<path>.index.json` with max_shard_size bytes). Otherwise a folder (diffusers: diffusion_pytorch_model*.safetensors
    + config.json; sai: sd3*.safetensors). SAI keys carry `prefix`, default `model.diffusion_model.` as SAI's own
    files (pass "" for a bare transformer file). Returns the files written."""
    if layout not in ("sai", "diffusers"):
        raise ValueError(f"layout must be 'sai' or 'diffusers', got {layout!r}")
    if prefix is not None and layout != "sai":
        raise ValueError("prefix applies to the SAI layout only (diffusers keys have none)")
    p = model.params
    with flame.no_grad():
        state = {k: t.detach() for k, t in _model_tensors(model).items()}
        if layout == "diffusers":
            state = K.sai_to_diffusers(state, p)
        else:
            pre = SAI_PREFIX if prefix is None else prefix
            state = {pre + k: t for k, t in state.items()}
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        folder, stem = os.path.dirname(path) or ".", os.path.basename(path)[:-len(".safetensors")]
    else:
        folder, stem = path, ("diffusion_pytorch_model" if layout == "diffusers" else "sd3")
        os.makedirs(folder, exist_ok=True)
        if layout == "diffusers":
            _write_json(diffusers_config(p), os.path.join(folder, "config.json"))
    metadata = {"format": "pt", PARAMS_METADATA_KEY: json.dumps(_params_dict(p))}
    groups = _shards(list(state.items()), max_shard_size)
    if len(groups) == 1:
        out = os.path.join(folder, stem + ".safetensors")
        save_file(dict(groups[0]), out, metadata=metadata)
        return [out]
    files, weight_map = [], {}
    for i, g in enumerate(groups):
        name = f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(dict(g), os.path.join(folder, name), metadata=metadata)
        files.append(os.path.join(folder, name))
        weight_map.update({k: name for k, _ in g})
    index = os.path.join(folder, stem + INDEX_SUFFIX)
    _write_json({"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}, index)
    return files + [index]


def _params_dict(p):
    from dataclasses import asdict
    d = asdict(p)
    d["dual_attention_layers"] = list(d["dual_attention_layers"])
    return d
