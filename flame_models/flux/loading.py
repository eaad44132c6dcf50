"""Load and save Flux transformers: BFL single files (optionally `model.diffusion_model.`-prefixed) and diffusers
files or folders (sharded, with their index JSON). Loading reads one tensor at a time straight into the target
dtype and device, into a model built under `flame_nn.empty_init` (no random initialisation, no second copy)."""
import dataclasses
import json
import os

import flame_core as flame
import flame_nn
from flame_core.dtypes import dtype_of
from flame_core.io import safe_open, save_file

from . import keys as K
from .params import FluxParams, configs

INDEX_SUFFIX = ".safetensors.index.json"
PARAMS_METADATA_KEY = "flame.flux_params"


class FluxCheckpointError(flame.FlameError, RuntimeError):
    """A Flux checkpoint with missing, unexpected or misshaped tensors, or an unreadable layout."""


# ----------------------------------------------------------------------------- finding the files
def checkpoint_files(path):
    """The safetensors files of a checkpoint: a file, an index JSON, or a folder (diffusers `transformer/` too)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        sub = os.path.join(path, "transformer")
        if os.path.isdir(sub) and not any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in os.listdir(path)):
            return checkpoint_files(sub)
        indexes = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
        if len(indexes) > 1:
            raise FluxCheckpointError(f"{path}: several index files ({', '.join(indexes)}); pass one of them")
        if indexes:
            return checkpoint_files(os.path.join(path, indexes[0]))
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if len(files) != 1:
            raise FluxCheckpointError(f"{path}: expected one .safetensors file or an index JSON, found "
                                      f"{len(files)} safetensors files ({', '.join(files[:5])})")
        return [os.path.join(path, files[0])]
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FluxCheckpointError(f"{path}: an index JSON needs a non-empty 'weight_map'")
        folder = os.path.dirname(path)
        names = list(dict.fromkeys(weight_map.values()))
        files = [os.path.join(folder, n) for n in names]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise FluxCheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(absent)}")
        return files
    if not os.path.exists(path):
        raise FileNotFoundError(f"no Flux checkpoint at {path}")
    return [path]


class _Checkpoint:
    """Open safetensors handles of one checkpoint, its key index (prefix stripped) and its layout."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files = checkpoint_files(path)
        self.handles = [safe_open(f) for f in self.files]
        raw = {}
        for h in self.handles:
            for k in h.keys():
                if k in raw:
                    raise FluxCheckpointError(f"{self.path}: tensor {k!r} appears in two files, "
                                              f"{raw[k].filename} and {h.filename}")
                raw[k] = h
        self.prefix, stripped = K.strip_prefix(raw)
        self.index = {k: raw[self.prefix + k] for k in stripped}
        self.layout = K.detect_layout(self.index)

    def shape(self, key):
        return tuple(self.index[key].shape(self.prefix + key))

    def get(self, key, dtype, device):
        return self.index[key].get_tensor(self.prefix + key, dtype=dtype, device=device)

    def metadata_params(self):
        for h in self.handles:
            meta = h.metadata() or {}
            if PARAMS_METADATA_KEY in meta:
                return FluxParams(**json.loads(meta[PARAMS_METADATA_KEY]))
        return None

    def close(self):
        for h in self.handles:
            h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- the config from the weights
# what each field is read from: (BFL key, diffusers key, dim)
_SHAPE_FIELDS = {
    "hidden_size": ("img_in.weight", "x_embedder.weight", 0),
    "in_channels": ("img_in.weight", "x_embedder.weight", 1),
    "context_in_dim": ("txt_in.weight", "context_embedder.weight", 1),
    "vec_in_dim": ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight", 1),
    "out_channels": ("final_layer.linear.weight", "proj_out.weight", 0),
    "head_dim": ("double_blocks.0.img_attn.norm.query_norm.scale", "transformer_blocks.0.attn.norm_q.weight", 0),
    "mlp_hidden": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.net.0.proj.weight", 0),
}


def infer_params(ckpt):
    """FluxParams of a checkpoint: from FLAME's own metadata when saved by `save_flux`, else from the shapes.
    RoPE axes are not stored in the weights: a head dim of 128 means BFL's (16, 56, 56); other head dims must match
    a preset (or pass `params=` to load_flux)."""
    p = ckpt.metadata_params()
    if p is not None:
        return p
    col = 0 if ckpt.layout == "bfl" else 1
    try:
        f = {name: ckpt.shape(keys[col])[keys[2]] for name, keys in _SHAPE_FIELDS.items()}
    except KeyError as e:
        raise FluxCheckpointError(f"{ckpt.path}: cannot infer the Flux config, missing {e}") from None
    if ckpt.layout == "bfl":
        depth = _count(ckpt.index, "double_blocks.", ".img_attn.qkv.weight")
        single = _count(ckpt.index, "single_blocks.", ".linear1.weight")
        guidance = "guidance_in.in_layer.weight" in ckpt.index
        qkv_bias = "double_blocks.0.img_attn.qkv.bias" in ckpt.index
    else:
        depth = _count(ckpt.index, "transformer_blocks.", ".attn.to_q.weight")
        single = _count(ckpt.index, "single_transformer_blocks.", ".attn.to_q.weight")
        guidance = "time_text_embed.guidance_embedder.linear_1.weight" in ckpt.index
        qkv_bias = "transformer_blocks.0.attn.to_q.bias" in ckpt.index
    H, D = f["hidden_size"], f["head_dim"]
    axes = (16, 56, 56) if D == 128 else next(
        (c.axes_dim for c in configs.values() if c.head_dim == D and c.hidden_size == H), None)
    if axes is None:
        raise FluxCheckpointError(f"{ckpt.path}: head dim {D} is not Flux's 128 and matches no preset, so the RoPE "
                                  f"axes are unknown; pass params=FluxParams(...)")
    return FluxParams(in_channels=f["in_channels"], out_channels=f["out_channels"], vec_in_dim=f["vec_in_dim"],
                      context_in_dim=f["context_in_dim"], hidden_size=H, mlp_ratio=f["mlp_hidden"] / H,
                      num_heads=H // D, depth=depth, depth_single_blocks=single, axes_dim=axes,
                      qkv_bias=qkv_bias, guidance_embed=guidance)


def read_flux_params(path):
    """FluxParams of a checkpoint (file, folder or index JSON) from its headers alone: no tensor is read."""
    with _Checkpoint(path) as ckpt:
        return infer_params(ckpt)


def _count(index, prefix, suffix):
    return sum(1 for k in index if k.startswith(prefix) and k.endswith(suffix)
               and k[len(prefix):-len(suffix)].isdigit())


# ----------------------------------------------------------------------------- loading
def _sources(ckpt, params):
    """{BFL key: (file keys, how)} for the checkpoint's layout."""
    if ckpt.layout == "bfl":
        return {k: ((k,), "copy") for k in K.bfl_shapes(params)}
    return {k: (dkeys, how) for k, (dkeys, how, _) in K.diffusers_plan(params).items()}


def _source_shape(ckpt, dkeys, how):
    shapes = [ckpt.shape(k) for k in dkeys]
    if how != "cat":
        return shapes[0]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        return tuple(shapes)  # pieces that cannot be concatenated: reported as they are
    return (sum(s[0] for s in shapes),) + shapes[0][1:]


def load_flux_state_(model, path, *, strict=True):
    """Load a checkpoint file/folder into `model` (a Flux, possibly built under empty_init), one tensor at a time,
    each converted to its parameter's dtype and device. Raises FluxCheckpointError naming missing, unexpected and
    misshaped keys (in the file's own names) before reading any tensor."""
    params_by_name = dict(model.named_parameters())
    with _Checkpoint(path) as ckpt:
        sources = _sources(ckpt, model.params)
        unknown = sorted(set(sources) ^ set(params_by_name))
        if unknown:
            raise FluxCheckpointError(f"model and plan disagree on {unknown[:10]}: is this a flame_models Flux?")
        used = {k for dkeys, _ in sources.values() for k in dkeys}
        missing = [k for dkeys, _ in sources.values() for k in dkeys if k not in ckpt.index]
        unexpected = [k for k in ckpt.index if k not in used]
        misshaped = []
        for key, (dkeys, how) in sources.items():
            if all(k in ckpt.index for k in dkeys):
                got, want = _source_shape(ckpt, dkeys, how), tuple(params_by_name[key].shape)
                if got != want:
                    misshaped.append(f"{'+'.join(dkeys)}: {got} in the file, {want} in the model ({key})")
        if misshaped or (strict and (missing or unexpected)):
            raise FluxCheckpointError(_load_error(ckpt, missing, unexpected, misshaped))
        loaded = {}
        with flame.no_grad():
            for key, (dkeys, how) in sources.items():
                if all(k in ckpt.index for k in dkeys):
                    p = params_by_name[key]
                    pieces = [ckpt.get(k, dtype=p.dtype, device=p.device) for k in dkeys]
                    loaded[key] = K.combine(how, pieces)
                    del pieces
    # assign=True: each converted tensor's storage becomes the parameter's (no second copy of the model)
    model.load_state_dict(loaded, strict=False, assign=True)
    return model


def _load_error(ckpt, missing, unexpected, misshaped):
    def listing(xs):
        return ", ".join(xs[:20]) + (f", ... and {len(xs) - 20} more" if len(xs) > 20 else "")
    lines = [f"cannot load the Flux checkpoint {ckpt.path} ({ckpt.layout} layout"
             + (f", prefix {ckpt.prefix!r}" if ckpt.prefix else "") + "):"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {listing(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {listing(unexpected)}")
    if misshaped:
        lines.append(f"  misshaped ({len(misshaped)}): " + "; ".join(misshaped[:20]))
    return "\n".join(lines)


def load_flux(path, dtype=None, device=None, *, params=None, strict=True):
    """A Flux model from a BFL or diffusers checkpoint (file, folder or index JSON), built under empty_init and
    filled one tensor at a time, each converted to `dtype` (default: the dtype stored in the file) on `device`
    (default: the default device). `params` overrides the config inferred from the checkpoint."""
    from .model import Flux
    with _Checkpoint(path) as ckpt:
        if params is None:
            params = infer_params(ckpt)
        if dtype is None:
            probe = K.BFL_PROBE if ckpt.layout == "bfl" else K.DIFFUSERS_PROBE
            dtype = dtype_of(ckpt.index[probe].dtype(ckpt.prefix + probe))
    with flame_nn.empty_init(device=device, dtype=dtype):
        model = Flux(params)
    return load_flux_state_(model, path, strict=strict)


# ----------------------------------------------------------------------------- saving
def _diffusers_config(p):
    return {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": p.in_channels,
            "out_channels": p.out_channels, "num_layers": p.depth, "num_single_layers": p.depth_single_blocks,
            "attention_head_dim": p.head_dim, "num_attention_heads": p.num_heads,
            "joint_attention_dim": p.context_in_dim, "pooled_projection_dim": p.vec_in_dim,
            "guidance_embeds": p.guidance_embed, "axes_dims_rope": list(p.axes_dim)}


def _shards(items, max_shard_size):
    """Split [(key, tensor)] into consecutive groups of at most max_shard_size bytes (one tensor may exceed it)."""
    groups, cur, size = [], [], 0
    for k, t in items:
        n = t.nbytes
        if cur and max_shard_size is not None and size + n > max_shard_size:
            groups.append(cur)
            cur, size = [], 0
        cur.append((k, t))
        size += n
    if cur:
        groups.append(cur)
    return groups


def save_flux(model, path, layout="bfl", *, max_shard_size=None):
    """Save `model` in BFL ("bfl") or diffusers ("diffusers") layout. `path` ending in .safetensors: one file (or
    shards `<stem>-0000i-of-0000n.safetensors` plus `<path>.index.json` with max_shard_size bytes). Otherwise a folder
    (diffusers: diffusion_pytorch_model*.safetensors + config.json; bfl: flux*.safetensors). Returns the files written."""
    if layout not in ("bfl", "diffusers"):
        raise ValueError(f"layout must be 'bfl' or 'diffusers', got {layout!r}")
    p = model.params
    state = {k: t for k, t in model.named_parameters()}
    with flame.no_grad():
        state = {k: t.detach() for k, t in state.items()}
        if layout == "diffusers":
            state = K.bfl_to_diffusers(state, p)
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        folder, stem = os.path.dirname(path) or ".", os.path.basename(path)[:-len(".safetensors")]
    else:
        folder, stem = path, ("diffusion_pytorch_model" if layout == "diffusers" else "flux")
        os.makedirs(folder, exist_ok=True)
        if layout == "diffusers":
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(_diffusers_config(p), f, indent=2)
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
    with open(index + ".tmp", "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map},
                  f, indent=2)
    os.replace(index + ".tmp", index)
    return files + [index]


def _params_dict(p):
    d = dataclasses.asdict(p)
    d["axes_dim"] = list(d["axes_dim"])
    return d
