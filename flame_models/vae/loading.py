"""load_vae: an AutoencoderKL from a BFL `ae.safetensors`, a diffusers `vae/` folder or file, or an SAI / ComfyUI
single file (a full checkpoint whose VAE sits under `first_stage_model.` or `vae.`, or a bare LDM-named VAE).

The file's header alone decides what it is, which layout and prefix it uses and the config (unless a diffusers
config.json says it); missing, unexpected and misshaped tensors are reported before any tensor is read. The model
is built under `flame_nn.empty_init` and filled one tensor at a time, each read straight into the target dtype and
device.
"""
import json
import os

import flame_core as flame
import flame_nn

from .. import checkpoint_io as CIO
from . import keys as K
from .config import VAEConfig, VAEConfigError
from .saving import CONFIG_METADATA_KEY

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CONFIG_NAME = "config.json"


class VAECheckpointError(CIO.CheckpointError, RuntimeError):
    """A file or folder that holds no VAE, or a VAE with missing, unexpected or misshaped tensors."""


# ----------------------------------------------------------------------------- finding the files
def _folder_weights(folder):
    """A VAE is one file: diffusers' name, else the folder's only .safetensors file."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if WEIGHTS_NAME in names:
        return os.path.join(folder, WEIGHTS_NAME)
    if len(names) == 1:  # a variant such as diffusion_pytorch_model.fp16.safetensors, or a lone VAE file
        return os.path.join(folder, names[0])
    if not names:
        raise VAECheckpointError(f"{folder}: no .safetensors file in this folder")
    raise VAECheckpointError(f"{folder}: several .safetensors files ({', '.join(names[:6])}); pass the VAE file")


def find_vae_files(path):
    """(weights file, diffusers config dict or None, where the config came from) for a file or a folder
    (a diffusers `vae/` folder, or a pipeline folder that contains one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = CIO.pipeline_subfolder(path, "vae")
        cfg = CIO.read_config_json(path, VAECheckpointError)
        if cfg is not None and cfg.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
            raise VAECheckpointError(f"{path} is not a VAE folder: its config.json describes a "
                                     f"{cfg.get('_class_name')!r}, not an AutoencoderKL")
        return _folder_weights(path), cfg, (os.path.join(path, CONFIG_NAME) if cfg is not None else None)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no VAE checkpoint at {path}")
    CIO.check_not_pickle(path, VAECheckpointError)
    folder = os.path.dirname(path) or "."
    cfg = CIO.read_config_json(folder, VAECheckpointError)
    if cfg is not None and cfg.get("_class_name") == "AutoencoderKL":  # a diffusers vae/ file named directly
        return path, cfg, os.path.join(folder, CONFIG_NAME)
    return path, None, None


class VAECheckpoint(CIO.SafetensorsCheckpoint):
    """An open VAE safetensors file: its prefix, layout, and the file name of each LDM key (header only)."""

    error = VAECheckpointError

    def __init__(self, path):
        self.path = os.fspath(path)
        self.file, self.json_config, self.config_source = find_vae_files(path)
        super().__init__([self.file], label=self.file)

    def scan_keys(self):
        all_keys = list(self.handle_of)
        self.prefix = K.find_prefix(all_keys)
        if self.prefix is None:
            sample = ", ".join(all_keys[:3]) + (", ..." if len(all_keys) > 3 else "")
            raise VAECheckpointError(
                f"{self.file} is not a VAE checkpoint: it looks like {K.describe(all_keys)} ({len(all_keys)} "
                f"tensors: {sample}); a VAE has {K.PROBES[0]} (bare, or under first_stage_model. or vae.)")
        self.vae_keys = CIO.keys_under(all_keys, self.prefix)
        self.metadata_config = self.metadata(CONFIG_METADATA_KEY)  # written by save_vae
        self.layout = K.detect_layout(self.vae_keys)
        if self.layout is None:
            raise VAECheckpointError(f"{self.file}: VAE keys in neither the LDM (encoder.down.0...) nor the diffusers "
                                     f"(encoder.down_blocks.0...) layout, or in both")
        self.old_attention = self.layout == "diffusers" and K.has_old_attention(self.vae_keys)
        down = r"^encoder\.down\.(\d+)\." if self.layout == "ldm" else r"^encoder\.down_blocks\.(\d+)\."
        self.num_levels = CIO.count_indices(self.vae_keys, down)

    def file_key(self, ldm_key):
        """The name (prefix stripped) this file gives an LDM key."""
        if self.layout == "ldm":
            return ldm_key
        return K.ldm_to_diffusers_key(ldm_key, self.num_levels, self.old_attention)

    def source_key(self, ldm_key):
        return self.prefix + self.file_key(ldm_key)


# ----------------------------------------------------------------------------- the config from the weights
def infer_config(ckpt, overrides=None):
    """The VAEConfig of a checkpoint: from its diffusers config.json or the config save_vae stored in its metadata,
    else from the shapes (GroupNorm's group count is not in the weights: 32, the LDM value, unless told otherwise).
    `overrides`: a dict of VAEConfig fields that replace what was read or inferred."""
    fields = _config_fields(ckpt)
    if overrides:
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise VAECheckpointError(f"load_vae: unknown VAEConfig field(s) {unknown}; known: {', '.join(fields)}")
        fields.update(overrides)
    try:
        return VAEConfig(**fields)
    except VAEConfigError as e:
        hint = "" if overrides and "norm_num_groups" in overrides else " (pass config={'norm_num_groups': ...})"
        raise VAECheckpointError(f"{ckpt.describe()}: {e}{hint}") from None


def _config_fields(ckpt):
    """VAEConfig fields (a dict) from the checkpoint's config.json, or FLAME's metadata, or else its shapes."""
    if ckpt.json_config is not None:
        try:
            return VAEConfig.from_diffusers_config(ckpt.json_config, source=ckpt.config_source).to_dict()
        except VAEConfigError as e:
            raise VAECheckpointError(str(e)) from None
    if ckpt.metadata_config is not None:
        try:
            fields = json.loads(ckpt.metadata_config)
            return VAEConfig(**fields).to_dict()
        except (ValueError, TypeError) as e:
            raise VAECheckpointError(f"{ckpt.file}: unreadable {CONFIG_METADATA_KEY} metadata ({e})") from None

    def shape(ldm_key):
        if not ckpt.has(ldm_key):
            raise VAECheckpointError(f"cannot infer the VAE config of {ckpt.describe()}: it has no "
                                     f"{ckpt.prefix + ckpt.file_key(ldm_key)}")
        return ckpt.shape(ldm_key)

    n = ckpt.num_levels
    if n == 0:
        raise VAECheckpointError(f"cannot infer the VAE config of {ckpt.describe()}: no encoder levels "
                                 f"({ckpt.prefix + ckpt.file_key('encoder.down.0.block.0.conv1.weight')})")
    ch, in_channels = shape("encoder.conv_in.weight")[:2]
    level_channels = [shape(f"encoder.down.{i}.block.0.conv2.weight")[0] for i in range(n)]
    bad = [c for c in level_channels if c % ch]
    if bad:
        raise VAECheckpointError(f"cannot infer the VAE config of {ckpt.describe()}: level channels "
                                 f"{level_channels} are not multiples of conv_in's {ch}")
    blocks = 0
    while ckpt.has(f"encoder.down.0.block.{blocks}.conv1.weight"):
        blocks += 1
    dec_blocks = 0
    while ckpt.has(f"decoder.up.0.block.{dec_blocks}.conv1.weight"):
        dec_blocks += 1
    if dec_blocks != blocks + 1:
        raise VAECheckpointError(f"cannot infer the VAE config of {ckpt.describe()}: {blocks} ResnetBlocks per "
                                 f"encoder level but {dec_blocks} per decoder level (the LDM VAE has one more in "
                                 f"the decoder)")
    fields = VAEConfig().to_dict()
    fields.update(in_channels=in_channels, out_channels=shape("decoder.conv_out.weight")[0], ch=ch,
                  ch_mult=[c // ch for c in level_channels], num_res_blocks=blocks,
                  z_channels=shape("decoder.conv_in.weight")[1], use_quant_conv=ckpt.has("quant_conv.weight"),
                  use_post_quant_conv=ckpt.has("post_quant_conv.weight"),
                  mid_attention=ckpt.has("encoder.mid.attn_1.q.weight"))
    return fields


# ----------------------------------------------------------------------------- loading
def _shape_fits(ldm_key, got, want):
    if got == want:
        return True
    # diffusers keeps the attention's 1x1 convs as Linear (C, C); old files have Conv1d-style (C, C, 1)
    return K.is_attention_weight(ldm_key) and tuple(s for s in got if s != 1) == want[:2] and len(got) in (2, 3)


def load_vae_state_(model, ckpt, *, strict=True):
    """Fill `model` (an AutoencoderKL, typically built under empty_init) from an open VAECheckpoint, one tensor at
    a time in each parameter's dtype and device. Raises VAECheckpointError naming missing, unexpected and
    misshaped tensors (by their names in the file) before reading any."""
    params = dict(model.named_parameters())
    plan = {k: ckpt.file_key(k) for k in params}
    used = set(plan.values())
    missing = [ckpt.prefix + fk for k, fk in plan.items() if not ckpt.has(k)]
    unexpected = [ckpt.prefix + k for k in ckpt.vae_keys if k not in used]
    misshaped = []
    for k, fk in plan.items():
        if ckpt.has(k):
            got, want = ckpt.shape(k), tuple(params[k].shape)
            if not _shape_fits(k, got, want):
                misshaped.append(f"{ckpt.prefix + fk}: {got} in the file, {want} in the model")
    c = model.config
    CIO.check_mismatch(VAECheckpointError, f"cannot load the VAE {ckpt.describe()} into AutoencoderKL(ch={c.ch}, "
                       f"ch_mult={c.ch_mult}, num_res_blocks={c.num_res_blocks}, z_channels={c.z_channels}, "
                       f"quant_conv={c.use_quant_conv}, post_quant_conv={c.use_post_quant_conv}):", missing,
                       unexpected, misshaped, strict=strict)
    present = {k: p for k, p in params.items() if ckpt.has(k)}
    return CIO.fill_(model, lambda k, p: ckpt.get_like(k, p).reshape(tuple(p.shape)), present, desc="loading VAE")


def load_vae(path, dtype=None, device=None, *, config=None, strict=True):
    """An AutoencoderKL from a VAE file or folder, in `dtype` (default: the file's) on `device` (default: the
    default device), frozen (requires_grad False) and in eval mode.

    `config`: a VAEConfig to use instead of the inferred one, or a dict of fields to change in it (e.g.
    {'norm_num_groups': 4} for a custom VAE whose group count the weights cannot tell). `strict=False` tolerates
    unexpected tensors and leaves missing ones unloaded (they raise when used)."""
    from .model import AutoencoderKL
    with VAECheckpoint(path) as ckpt:
        cfg = CIO.config_argument(config, VAEConfig, lambda overrides: infer_config(ckpt, overrides), caller="load_vae")
        if dtype is None:
            dtype = CIO.compute_dtype(ckpt.stored_dtype("encoder.conv_in.weight") if ckpt.has("encoder.conv_in.weight")
                                      else flame.get_default_dtype())
        with flame_nn.empty_init(device=device, dtype=dtype):
            model = AutoencoderKL(cfg)
        load_vae_state_(model, ckpt, strict=strict)
    model.requires_grad_(False)
    return model.eval()
