"""save_vae: an AutoencoderKL to an LDM-named single file (what BFL's ae.safetensors and ComfyUI's models/vae/ hold)
or to a diffusers `vae/` folder. FLAME's own files carry the config in their metadata, so load_vae gets back even
what the weights cannot tell (the GroupNorm group count, the tile size)."""
import json
import os

import flame_core as flame
from flame_core.io import save_file

from .. import checkpoint_io as CIO
from . import keys as K

CONFIG_METADATA_KEY = "flame.vae_config"


def save_vae(vae, path, layout="ldm"):
    """Write `vae`'s weights. layout "ldm": `path` is a .safetensors file with LDM / BFL names; "diffusers": `path`
    is a folder that gets config.json and diffusion_pytorch_model.safetensors (mid-block attention as Linear
    weights). Each file is written to a temporary name and renamed. Returns the paths written."""
    if layout not in ("ldm", "diffusers"):
        raise ValueError(f"save_vae: layout must be 'ldm' or 'diffusers', got {layout!r}")
    c = vae.config
    metadata = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(c.to_dict(), sort_keys=True)}
    with flame.no_grad():
        state = {k: p.detach() for k, p in vae.named_parameters()}
        if layout == "diffusers":
            n = len(c.ch_mult)
            state = {K.ldm_to_diffusers_key(k, n): (t.reshape(t.shape[0], t.shape[1]) if K.is_attention_weight(k)
                                                     else t) for k, t in state.items()}
    path = os.fspath(path)
    if layout == "ldm":
        if not path.endswith(".safetensors"):
            raise ValueError(f"save_vae: an LDM-layout VAE is one .safetensors file, got {path!r}")
        save_file(state, path, metadata=metadata)
        return [path]
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, "diffusion_pytorch_model.safetensors")
    save_file(state, weights, metadata=metadata)
    config = os.path.join(path, "config.json")
    CIO.write_json(config, c.to_diffusers_config())
    return [weights, config]
