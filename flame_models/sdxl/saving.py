"""save_unet: an SDXLUNet to an SAI-named single file (what SAI checkpoints and ComfyUI hold: `model.diffusion_model.`
keys) or to diffusers' layout (a `unet/` folder with config.json, optionally sharded, or one diffusers-named file).
FLAME's files carry the config in their metadata, so load_unet gets back what the weights cannot tell (head size,
group count, size-embedding width). Every file is written to a temporary name, fsynced and renamed."""
import json
import os

import flame_core as flame
from flame_core.io import save_file

from . import keys as K
from .loading import CONFIG_METADATA_KEY, INDEX_SUFFIX

WEIGHTS_STEM = "diffusion_pytorch_model"


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shards(items, max_shard_size):
    """[(key, tensor)] in consecutive groups of at most max_shard_size bytes (one tensor may exceed it)."""
    groups, cur, size = [], [], 0
    for k, t in items:
        if cur and max_shard_size is not None and size + t.nbytes > max_shard_size:
            groups.append(cur)
            cur, size = [], 0
        cur.append((k, t))
        size += t.nbytes
    if cur:
        groups.append(cur)
    return groups


def save_unet(model, path, layout="sai", *, prefix=K.SAI_PREFIXES[0], max_shard_size=None):
    """Write `model`'s weights. layout "sai": `path` is a .safetensors file, keys under `prefix`
    ('model.diffusion_model.', as SAI single files; '' for a bare UNet file). layout "diffusers": `path` is a folder
    (config.json + diffusion_pytorch_model.safetensors, or shards of at most max_shard_size bytes with their index
    JSON), or a .safetensors file with diffusers names and no config.json. Returns the paths written."""
    if layout not in ("sai", "diffusers"):
        raise ValueError(f"save_unet: layout must be 'sai' or 'diffusers', got {layout!r}")
    c = model.config
    path = os.fspath(path)
    single = path.endswith(".safetensors")
    if layout == "sai" and not single:
        raise ValueError(f"save_unet: an SAI-layout UNet is one .safetensors file, got {path!r}")
    if max_shard_size is not None and (layout != "diffusers" or single):
        raise ValueError("save_unet: max_shard_size applies to a diffusers folder only")
    with flame.no_grad():
        state = [(k, p.detach()) for k, p in model.named_parameters()]
    if layout == "sai":
        state = [(prefix + k, t) for k, t in state]
    else:
        state = [(K.sai_to_diffusers_key(k, c.num_res_blocks), t) for k, t in state]
    metadata = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(c.to_dict(), sort_keys=True)}
    if single:
        save_file(dict(state), path, metadata=metadata)
        return [path]
    os.makedirs(path, exist_ok=True)
    written = []
    groups = _shards(state, max_shard_size)
    if len(groups) == 1:
        out = os.path.join(path, WEIGHTS_STEM + ".safetensors")
        save_file(dict(groups[0]), out, metadata=metadata)
        written.append(out)
    else:
        weight_map = {}
        for i, g in enumerate(groups):
            name = f"{WEIGHTS_STEM}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(dict(g), os.path.join(path, name), metadata=metadata)
            written.append(os.path.join(path, name))
            weight_map.update({k: name for k, _ in g})
        index = os.path.join(path, WEIGHTS_STEM + INDEX_SUFFIX)
        _write_json(index, {"metadata": {"total_size": sum(t.nbytes for _, t in state)}, "weight_map": weight_map})
        written.append(index)
    config = os.path.join(path, "config.json")
    _write_json(config, c.to_diffusers_config())
    return written + [config]
