"""load_unet: an SDXLUNet from an SAI / ComfyUI single file (the UNet under `model.diffusion_model.`; the VAE and
text encoders in the same file are left alone), a bare SAI-named UNet file, a diffusers `unet/` folder (config.json +
safetensors, possibly sharded with an index JSON, or a pipeline folder that contains `unet/`), or a diffusers-named
file.

The file headers alone decide the layout, the prefix and -- unless a config.json or FLAME's metadata says it -- the
config; missing, unexpected and misshaped tensors are reported (by their names in the file) before any tensor is read.
The model is built under `flame_nn.empty_init` and filled one tensor at a time, each read straight into the target
dtype and device.
"""
import json
import os

import flame_core as flame
import flame_nn

from .. import checkpoint_io as CIO
from . import keys as K
from .config import UNetConfig, UNetConfigError, configs

CONFIG_NAME = "config.json"
INDEX_SUFFIX = CIO.INDEX_SUFFIX
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CONFIG_METADATA_KEY = "flame.unet_config"


class UNetCheckpointError(CIO.CheckpointError, RuntimeError):
    """A file or folder that holds no SDXL UNet, or a UNet with missing, unexpected or misshaped tensors."""


# ----------------------------------------------------------------------------- finding the files
def _is_unet_config(cfg):
    name = cfg.get("_class_name")
    return name == "UNet2DConditionModel" or (name is None and "cross_attention_dim" in cfg)


def find_unet_files(path):
    """(safetensors files, diffusers config dict or None, where that config came from) for a file, an index JSON
    or a folder (a diffusers `unet/` folder, or a pipeline folder that contains one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = CIO.pipeline_subfolder(path, "unet")
        cfg = CIO.read_config_json(path, UNetCheckpointError)
        if cfg is not None and not _is_unet_config(cfg):
            raise UNetCheckpointError(f"{path} is not a UNet folder: its config.json describes a "
                                      f"{cfg.get('_class_name')!r}")
    files = CIO.safetensors_files(path, what="UNet", error=UNetCheckpointError, preferred=WEIGHTS_NAME)
    folder = os.path.dirname(files[0]) or "."
    cfg = CIO.read_config_json(folder, UNetCheckpointError)
    if cfg is None or not _is_unet_config(cfg):
        return files, None, None
    return files, cfg, os.path.join(folder, CONFIG_NAME)


class UNetCheckpoint(CIO.SafetensorsCheckpoint):
    """Open safetensors handles of one UNet checkpoint: its layout, prefix, and where each SAI-named key lives."""

    error = UNetCheckpointError

    def __init__(self, path):
        self.path = os.fspath(path)
        files, self.json_config, self.config_source = find_unet_files(path)
        super().__init__(files, label=self.path)

    def scan_keys(self):
        raw = self.handle_of
        self.prefix, self.layout = K.find_prefix(raw)
        if self.layout is None:
            keys = list(raw)
            sample = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
            raise UNetCheckpointError(
                f"{self.path} is not an SDXL UNet checkpoint: it looks like {K.describe(keys)} ({len(keys)} tensors: "
                f"{sample}); a UNet has {K.SAI_PROBE} (bare or under model.diffusion_model.) or diffusers' "
                f"{K.DIFFUSERS_PROBE} + down_blocks.*")
        file_keys = CIO.keys_under(raw, self.prefix)
        self.where = {}                  # SAI key -> its name in the file (prefix included)
        self.unexpected = []             # keys in the file (with prefix) that have no place in a UNet
        if self.layout == "sai":
            for k in file_keys:
                self.where[k] = self.prefix + k
        else:
            nrb, up_attn = K.diffusers_layout_facts(file_keys)
            for k in file_keys:
                try:
                    self.where[K.diffusers_to_sai_key(k, nrb, up_attn)] = self.prefix + k
                except KeyError:
                    self.unexpected.append(self.prefix + k)
        self.metadata_config = self.metadata(CONFIG_METADATA_KEY)

    def has(self, key):
        return key in self.where

    def source_key(self, key):
        """The name in the file (prefix included) of the SAI key `key`."""
        return self.where[key]

    file_key = source_key


# ----------------------------------------------------------------------------- the config from the weights
# the fields shapes decide; the others (head size, group count, size embedding width) come from a preset that
# matches them, else SDXL's values
_SHAPE_FIELDS = ("in_channels", "out_channels", "model_channels", "channel_mult", "num_res_blocks",
                 "transformer_depth", "transformer_depth_middle", "context_dim", "adm_in_channels")


def _shape_fields(ckpt):
    def shape(key):
        if not ckpt.has(key):
            raise UNetCheckpointError(f"cannot infer the UNet config of {ckpt.describe()}: it has no "
                                      f"{key if ckpt.layout == 'sai' else 'tensor for ' + key}")
        return ckpt.shape(key)

    keys = list(ckpt.where)
    mc, cin = shape("input_blocks.0.0.weight")[:2]
    blocks = CIO.count_indices(keys, r"^input_blocks\.(\d+)\.")
    levels, current = [], []
    for i in range(1, blocks):
        if ckpt.has(f"input_blocks.{i}.0.op.weight"):
            levels.append(current)
            current = []
            continue
        out_ch = shape(f"input_blocks.{i}.0.in_layers.2.weight")[0]
        depth = CIO.count_indices(keys, rf"^input_blocks\.{i}\.1\.transformer_blocks\.(\d+)\.")
        if depth and len(shape(f"input_blocks.{i}.1.proj_in.weight")) != 2:
            raise UNetCheckpointError(f"{ckpt.describe()}: its transformers project with 1x1 convs (SD 1.x / 2.x "
                                      f"layout); only SDXL's linear projections are supported")
        current.append((out_ch, depth))
    levels.append(current)
    nrb = len(levels[0])
    if nrb == 0 or any(len(lv) != nrb for lv in levels):
        raise UNetCheckpointError(f"cannot infer the UNet config of {ckpt.describe()}: ResBlocks per level "
                                  f"{[len(lv) for lv in levels]} differ")
    for lv in levels:
        if len(set(lv)) != 1:
            raise UNetCheckpointError(f"cannot infer the UNet config of {ckpt.describe()}: one level has ResBlocks "
                                      f"of channels / depths {lv}")
    level_channels = [lv[0][0] for lv in levels]
    if any(c % mc for c in level_channels):
        raise UNetCheckpointError(f"cannot infer the UNet config of {ckpt.describe()}: level channels "
                                  f"{level_channels} are not multiples of {mc}")
    first_attn = next((i for i in range(1, blocks) if ckpt.has(f"input_blocks.{i}.1.transformer_blocks.0"
                                                                  f".attn2.to_k.weight")), None)
    ctx_key = (f"input_blocks.{first_attn}.1" if first_attn is not None else "middle_block.1") \
        + ".transformer_blocks.0.attn2.to_k.weight"
    return dict(in_channels=cin, out_channels=shape("out.2.weight")[0], model_channels=mc,
                channel_mult=tuple(c // mc for c in level_channels), num_res_blocks=nrb,
                transformer_depth=tuple(lv[0][1] for lv in levels),
                transformer_depth_middle=CIO.count_indices(keys, r"^middle_block\.1\.transformer_blocks\.(\d+)\."),
                context_dim=shape(ctx_key)[1], adm_in_channels=shape("label_emb.0.0.weight")[1])


def infer_config(ckpt, overrides=None):
    """The UNetConfig of a checkpoint: from its diffusers config.json or the config save_unet stored in its metadata,
    else from the shapes, with the head size, GroupNorm group count and size-embedding width (not in the weights) of
    the preset whose shapes match (SDXL's 64 / 32 / 256 otherwise). `overrides`: UNetConfig fields to change."""
    try:
        if ckpt.json_config is not None:
            fields = UNetConfig.from_diffusers_config(ckpt.json_config, source=ckpt.config_source).to_dict()
        elif ckpt.metadata_config is not None:
            try:
                fields = UNetConfig(**json.loads(ckpt.metadata_config)).to_dict()
            except (ValueError, TypeError) as e:
                raise UNetCheckpointError(f"{ckpt.describe()}: unreadable {CONFIG_METADATA_KEY} metadata ({e})") \
                    from None
        else:
            fields = _shape_fields(ckpt)
            preset = next((c for c in configs.values() if all(getattr(c, f) == fields[f] for f in _SHAPE_FIELDS)),
                          UNetConfig())
            fields.update(num_head_channels=preset.num_head_channels, norm_num_groups=preset.norm_num_groups,
                          size_embed_dim=preset.size_embed_dim)
        if overrides:
            unknown = sorted(set(overrides) - set(UNetConfig().to_dict()))
            if unknown:
                raise UNetCheckpointError(f"load_unet: unknown UNetConfig field(s) {unknown}")
            fields.update(overrides)
        return UNetConfig(**fields)
    except UNetConfigError as e:
        raise UNetCheckpointError(f"{ckpt.describe()}: {e} (pass config={{...}} with the fields the weights cannot "
                                  f"tell: num_head_channels, norm_num_groups, size_embed_dim)") from None


# ----------------------------------------------------------------------------- loading
def load_unet_state_(model, ckpt, *, strict=True, progress=True):
    """Fill `model` (an SDXLUNet, typically built under empty_init) from an open UNetCheckpoint, one tensor at a time
    in each parameter's dtype and device. Raises UNetCheckpointError naming missing, unexpected and misshaped tensors
    (by their names in the file) before reading any."""
    params = dict(model.named_parameters())

    def name(k):  # how the file calls a model key
        return ckpt.file_key(k) if ckpt.has(k) else (
            ckpt.prefix + (k if ckpt.layout == "sai" else K.sai_to_diffusers_key(k, model.config.num_res_blocks)))

    missing = [name(k) for k in params if not ckpt.has(k)]
    unexpected = list(ckpt.unexpected) + [ckpt.file_key(k) for k in ckpt.where if k not in params]
    misshaped = [f"{name(k)}: {ckpt.shape(k)} in the file, {tuple(p.shape)} in the model"
                 for k, p in params.items() if ckpt.has(k) and ckpt.shape(k) != tuple(p.shape)]
    c = model.config
    CIO.check_mismatch(UNetCheckpointError, f"cannot load the UNet {ckpt.describe()} into SDXLUNet(model_channels="
                       f"{c.model_channels}, channel_mult={c.channel_mult}, num_res_blocks={c.num_res_blocks}, "
                       f"transformer_depth={c.transformer_depth}, context_dim={c.context_dim}, adm_in_channels="
                       f"{c.adm_in_channels}):", missing, unexpected, misshaped, strict=strict)
    present = {k: p for k, p in params.items() if ckpt.has(k)}
    return CIO.fill_(model, ckpt.get_like, present, desc="loading UNet", progress=progress,
                     read_stored=CIO.stored_fp8_reader(ckpt))


def load_unet(path, dtype=None, device=None, *, config=None, strict=True, progress=True):
    """An SDXLUNet from a checkpoint file or folder, in `dtype` (default: the file's; float8 files load as bfloat16)
    on `device` (default: the default device), in eval mode with requires_grad False (a trainer turns on what it
    trains).

    `config`: a UNetConfig used as is, or a dict of fields replacing the inferred ones. `strict=False` tolerates
    unexpected tensors and leaves missing ones unloaded (they raise when used)."""
    from .model import SDXLUNet
    with UNetCheckpoint(path) as ckpt:
        cfg = CIO.config_argument(config, UNetConfig, lambda overrides: infer_config(ckpt, overrides),
                                  caller="load_unet")
        if dtype is None:
            dtype = CIO.compute_dtype(ckpt.stored_dtype(K.SAI_PROBE) if ckpt.has(K.SAI_PROBE)
                                      else flame.get_default_dtype())
        with flame_nn.empty_init(device=device, dtype=dtype):
            model = SDXLUNet(cfg)
        load_unet_state_(model, ckpt, strict=strict, progress=progress)
    model.requires_grad_(False)
    return model.eval()
