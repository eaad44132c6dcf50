"""Load and save Qwen-Image transformers: diffusers folders (`transformer/` of a QwenImagePipeline folder, sharded
with their index JSON), single files in those names, and ComfyUI's files (the same names under
`model.diffusion_model.` / `diffusion_model.`), one tensor at a time into a model built under `flame_nn.empty_init`."""
import dataclasses
import json
import os

import flame_core as flame

from .. import checkpoint_io as CIO
from ..checkpoint_io.plans import combine
from . import keys as K
from .params import QwenImageParams, configs

PARAMS_METADATA_KEY = "flame.qwen_image_params"
_CONFIG_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_attention_heads",
                  "attention_head_dim", "joint_attention_dim", "axes_dims_rope")


class QwenImageCheckpointError(CIO.CheckpointError, RuntimeError):
    """A Qwen-Image checkpoint with missing, unexpected or misshaped tensors, or one that is no Qwen-Image model."""


def checkpoint_files(path):
    """The safetensors files of a checkpoint: a file, an index JSON, or a folder (a pipeline's `transformer/` too)."""
    return CIO.safetensors_files(path, what="Qwen-Image", error=QwenImageCheckpointError, subfolder="transformer")


class _Checkpoint(CIO.SafetensorsCheckpoint):
    error = QwenImageCheckpointError
    layout = "diffusers"

    def __init__(self, path):
        self.path = os.fspath(path)
        super().__init__(checkpoint_files(path), label=self.path)

    def scan_keys(self):
        self.prefix, self.index = K.strip_prefix(self.handle_of)
        if K.PROBE not in self.index or K.BLOCK_PROBE not in self.index:
            kind, words, example = CIO.describe_keys(list(self.handle_of))
            raise QwenImageCheckpointError(
                f"{self.path}: not a Qwen-Image transformer (no {K.PROBE!r} with {K.BLOCK_PROBE!r}, also under "
                f"{' / '.join(K.PREFIXES)}); it looks like {words}" + (f" (keys such as {example})" if example else ""))

    def metadata_params(self):
        meta = self.metadata(PARAMS_METADATA_KEY)
        return None if meta is None else QwenImageParams(**json.loads(meta))

    def folder_config(self):
        """The diffusers config.json beside the weights, or None."""
        config = CIO.read_config_json(os.path.dirname(self.files[0]), QwenImageCheckpointError)
        if config is not None and str(config.get("_class_name", "")).startswith("QwenImage"):
            self.config_source = os.path.join(os.path.dirname(self.files[0]), "config.json")
            return config
        return None


def params_from_config(config):
    """QwenImageParams of a diffusers QwenImageTransformer2DModel config dict (unknown fields ignored). Refuses the
    Edit / Layered variants' switches, which this model does not implement."""
    for flag in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        if config.get(flag):
            raise QwenImageCheckpointError(f"config {flag}=true: that Qwen-Image variant is not supported (only the "
                                           f"text-to-image transformer)")
    fields = {k: config[k] for k in _CONFIG_FIELDS if config.get(k) is not None}
    if "axes_dims_rope" in fields:
        fields["axes_dims_rope"] = tuple(fields["axes_dims_rope"])
    return QwenImageParams(**fields)


def infer_params(ckpt):
    """QwenImageParams of a checkpoint: FLAME's metadata, else the folder's config.json, else the shapes (a head dim
    of 128 means the release's RoPE axes (16, 56, 56); another head dim must match a preset)."""
    p = ckpt.metadata_params()
    if p is not None:
        return p
    config = ckpt.folder_config()
    if config is not None:
        return params_from_config(config)
    try:
        D, in_ch = ckpt.shape("img_in.weight")
        J = ckpt.shape("txt_in.weight")[1]
        hd = ckpt.shape("transformer_blocks.0.attn.norm_q.weight")[0]
        M = ckpt.shape("transformer_blocks.0.img_mlp.net.0.proj.weight")[0]
        out = ckpt.shape("proj_out.weight")[0]
    except KeyError as e:
        raise QwenImageCheckpointError(f"{ckpt.path}: cannot infer the Qwen-Image config, missing {e}") from None
    layers = len(CIO.block_indices(ckpt.index, "transformer_blocks.", ".img_mod.1.weight"))
    axes = (16, 56, 56) if hd == 128 else next(
        (c.axes_dims_rope for c in configs.values() if c.attention_head_dim == hd and c.hidden_size == D), None)
    if axes is None:
        raise QwenImageCheckpointError(f"{ckpt.path}: head dim {hd} is not Qwen-Image's 128 and matches no preset, "
                                       f"so the RoPE axes are unknown; pass params=QwenImageParams(...)")
    if D % hd or out % 4:
        raise QwenImageCheckpointError(f"{ckpt.path}: img_in {D} wide with heads of {hd}, proj_out {out} rows: not "
                                       f"a Qwen-Image layout")
    return QwenImageParams(in_channels=in_ch, out_channels=out // 4, num_layers=layers, num_attention_heads=D // hd,
                           attention_head_dim=hd, joint_attention_dim=J, mlp_ratio=M / D, axes_dims_rope=axes)


def read_qwen_image_params(path):
    """QwenImageParams of a checkpoint (file, folder or index JSON) from its headers and config alone."""
    with _Checkpoint(path) as ckpt:
        return infer_params(ckpt)


def load_qwen_image_state_(model, path, *, strict=True):
    """Load a checkpoint into `model` one tensor at a time; QwenImageCheckpointError naming every missing,
    unexpected and misshaped key (in the file's names) before any tensor is read."""
    with _Checkpoint(path) as ckpt:
        plan = {k: ((k,), "copy") for k in K.qwen_image_shapes(model.params)}
        return CIO.load_planned_(model, ckpt, plan, dict(model.named_parameters()), combine, what="Qwen-Image",
                                 strict=strict)


def load_qwen_image(path, dtype=None, device=None, *, params=None, strict=True):
    """A QwenImageTransformer2DModel from a diffusers folder / file (sharded with its index) or a ComfyUI file, built
    under empty_init and filled one tensor at a time in `dtype` (default: the file's; fp8 files: bfloat16) on
    `device`. `params` overrides the inferred config."""
    from .model import QwenImageTransformer2DModel
    with _Checkpoint(path) as ckpt:
        if params is None:
            params = infer_params(ckpt)
        if dtype is None:
            dtype = CIO.compute_dtype(ckpt.stored_dtype(K.PROBE))
    model = CIO.empty_model(_Checkpoint, path, QwenImageTransformer2DModel, infer=None, probes=None, params=params,
                            dtype=dtype, device=device)
    return load_qwen_image_state_(model, path, strict=strict)


def diffusers_config(p):
    """The config.json of a diffusers QwenImageTransformer2DModel with these params."""
    return {"_class_name": "QwenImageTransformer2DModel", "patch_size": p.patch_size, "in_channels": p.in_channels,
            "out_channels": p.out_channels, "num_layers": p.num_layers, "attention_head_dim": p.attention_head_dim,
            "num_attention_heads": p.num_attention_heads, "joint_attention_dim": p.joint_attention_dim,
            "guidance_embeds": False, "axes_dims_rope": list(p.axes_dims_rope)}


def save_qwen_image(model, path, *, max_shard_size=None, dtype=None, metadata=None):
    """Save `model` in diffusers' (= the release's) names: a .safetensors path (or shards), or a folder that gets
    diffusion_pytorch_model*.safetensors + config.json; dtype: the floating weights written in it (None: their own);
    metadata: more metadata entries. Returns the files written."""
    p = model.params
    if p.mlp_ratio != 4.0:
        raise ValueError(f"mlp_ratio {p.mlp_ratio}: diffusers' QwenImageTransformer2DModel has a fixed 4x MLP")
    CIO.check_saveable(model, "save_qwen_image")
    with flame.no_grad():
        state = [(k, t.detach()) for k, t in model.named_parameters()]
    metadata = {**(metadata or {}), "format": "pt", PARAMS_METADATA_KEY: json.dumps(dataclasses.asdict(p))}
    return CIO.save_weights(state, path, stem="diffusion_pytorch_model", metadata=metadata,
                            max_shard_size=max_shard_size, folder_config=diffusers_config(p), dtype=dtype)
