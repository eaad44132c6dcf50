"""save_unet: an SDXLUNet to an SAI-named single file (what SAI checkpoints and ComfyUI hold: `model.diffusion_model.`
keys) or to diffusers' layout (a `unet/` folder with config.json, optionally sharded, or one diffusers-named file).
FLAME's files carry the config in their metadata, so load_unet gets back what the weights cannot tell (head size,
group count, size-embedding width). Every file is written to a temporary name, fsynced and renamed."""
import json
import os

import flame_core as flame

from .. import checkpoint_io as CIO
from . import keys as K
from .loading import CONFIG_METADATA_KEY

WEIGHTS_STEM = "diffusion_pytorch_model"


def save_unet(model, path, layout="sai", *, prefix=K.SAI_PREFIXES[0], max_shard_size=None, dtype=None,
              metadata=None, extra=()):
    """Write `model`'s weights. layout "sai": `path` is a .safetensors file, keys under `prefix`
    ('model.diffusion_model.', as SAI single files; '' for a bare UNet file). layout "diffusers": `path` is a folder
    (config.json + diffusion_pytorch_model.safetensors, or shards of at most max_shard_size bytes with their index
    JSON), or a .safetensors file with diffusers names and no config.json. dtype: the floating weights written in it
    (None: their own); metadata: more metadata entries; extra: [(key, tensor or io.Deferred)] written after the
    UNet's as they are (layout sai: a checkpoint's other parts, CIO.other_tensors). Returns the paths written."""
    if layout not in ("sai", "diffusers"):
        raise ValueError(f"save_unet: layout must be 'sai' or 'diffusers', got {layout!r}")
    c = model.config
    path = os.fspath(path)
    single = path.endswith(".safetensors")
    if layout == "sai" and not single:
        raise ValueError(f"save_unet: an SAI-layout UNet is one .safetensors file, got {path!r}")
    if max_shard_size is not None and (layout != "diffusers" or single):
        raise ValueError("save_unet: max_shard_size applies to a diffusers folder only")
    CIO.check_saveable(model, "save_unet")
    with flame.no_grad():
        state = [(k, p.detach()) for k, p in model.named_parameters()]
    if layout == "sai":
        state = [(prefix + k, t) for k, t in state] + list(extra)
    elif extra:
        raise ValueError("save_unet: extra tensors go into an SAI-layout file only")
    else:
        state = [(K.sai_to_diffusers_key(k, c.num_res_blocks), t) for k, t in state]
    metadata = {**(metadata or {}), "format": "pt", CONFIG_METADATA_KEY: json.dumps(c.to_dict(), sort_keys=True)}
    written = CIO.save_weights(state, path, stem=WEIGHTS_STEM, metadata=metadata, max_shard_size=max_shard_size,
                               folder_config=c.to_diffusers_config(), dtype=dtype)
    return written if single else written + [os.path.join(path, "config.json")]
