"""What the checkpoints of every Flux-derived transformer (Flux / Kontext: bfl/loading.py; Chroma: chroma/loading.py)
share: the open files with their prefix and layout (BFL's names or diffusers'), FLAME's params metadata, the config read
from shapes, the RoPE axes, and saving in either layout. A family subclasses BflCheckpoint with its error, key layout
module (strip_prefix, detect_layout), params class and metadata key."""
import dataclasses
import json
import os

import flame_core as flame

from .. import checkpoint_io as CIO

# the config fields every Flux-derived transformer's shapes give: (BFL key, diffusers key, dim)
SHAPE_FIELDS = {
    "hidden_size": ("img_in.weight", "x_embedder.weight", 0),
    "in_channels": ("img_in.weight", "x_embedder.weight", 1),
    "context_in_dim": ("txt_in.weight", "context_embedder.weight", 1),
    "out_channels": ("final_layer.linear.weight", "proj_out.weight", 0),
    "head_dim": ("double_blocks.0.img_attn.norm.query_norm.scale", "transformer_blocks.0.attn.norm_q.weight", 0),
    "mlp_hidden": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.net.0.proj.weight", 0),
}


class BflCheckpoint(CIO.SafetensorsCheckpoint):
    """Open safetensors handles of one checkpoint; its keys (`index`, prefix stripped) and `layout` ("bfl" or
    "diffusers"). Subclasses set `error`, `what` (the model's name in messages), `key_layout` (a module with
    strip_prefix and detect_layout), `params_class` and `metadata_key`."""

    error = CIO.CheckpointError
    what = "Flux"
    key_layout = None
    params_class = None
    metadata_key = None

    def __init__(self, path):
        self.path = os.fspath(path)
        super().__init__(self.checkpoint_files(path), label=self.path)

    @classmethod
    def checkpoint_files(cls, path):
        """The safetensors files of a checkpoint: a file, an index JSON, or a folder (diffusers `transformer/`
        too)."""
        return CIO.safetensors_files(path, what=cls.what, error=cls.error, subfolder="transformer")

    def scan_keys(self):
        self.prefix, self.index = self.key_layout.strip_prefix(self.handle_of)
        try:
            self.layout = self.key_layout.detect_layout(self.index)
        except KeyError as e:  # the files hold no such transformer: the family's error, naming the path
            raise self.error(f"{self.path}: {e.args[0]}") from None

    def metadata_params(self):
        """The params FLAME's own save wrote into the metadata, or None."""
        meta = self.metadata(self.metadata_key)
        return None if meta is None else self.params_class(**json.loads(meta))

    def shape_fields(self, fields):
        """{field: size} from `fields` {field: (BFL key, diffusers key, dim)}, read in this checkpoint's layout."""
        col = 0 if self.layout == "bfl" else 1
        try:
            return {name: self.shape(keys[col])[keys[2]] for name, keys in fields.items()}
        except KeyError as e:
            raise self.error(f"{self.path}: cannot infer the {self.what} config, missing {e}") from None

    def count(self, prefix, suffix):
        """How many numbered blocks `prefix{i}suffix` the checkpoint holds."""
        return len(CIO.block_indices(self.index, prefix, suffix))

    def rope_axes(self, hidden_size, head_dim, configs):
        """The RoPE axes, which the weights do not store: a head dim of 128 means BFL's (16, 56, 56); another head
        dim must match one of `configs` (presets) in width too."""
        axes = (16, 56, 56) if head_dim == 128 else next(
            (c.axes_dim for c in configs.values() if c.head_dim == head_dim and c.hidden_size == hidden_size), None)
        if axes is None:
            raise self.error(f"{self.path}: head dim {head_dim} is not {self.what}'s 128 and matches no preset, so the "
                             f"RoPE axes are unknown; pass params={self.params_class.__name__}(...)")
        return axes


def diffusers_config(class_name, p, **extra):
    """A diffusers transformer's config.json of a Flux-derived model with params `p`; `extra`: the family's own
    fields, after the shared ones."""
    cfg = {"_class_name": class_name, "patch_size": 1, "in_channels": p.in_channels,
           "out_channels": p.out_channels, "num_layers": p.depth, "num_single_layers": p.depth_single_blocks,
           "attention_head_dim": p.head_dim, "num_attention_heads": p.num_heads,
           "joint_attention_dim": p.context_in_dim}
    cfg.update(extra)
    return cfg


def params_from_diffusers_config(params_class, c, **extra):
    """`params_class` of a diffusers transformer config (config.json's dict, the inverse of diffusers_config):
    the shared fields, and `extra`, the family's own read from it by the caller. diffusers' Flux-derived blocks have
    an MLP 4 x wide (FLUX.1's mlp_ratio, the params' default)."""
    return params_class(in_channels=c["in_channels"], out_channels=c.get("out_channels") or c["in_channels"],
                        context_in_dim=c["joint_attention_dim"],
                        hidden_size=c["num_attention_heads"] * c["attention_head_dim"],
                        num_heads=c["num_attention_heads"], depth=c["num_layers"],
                        depth_single_blocks=c["num_single_layers"], axes_dim=tuple(c["axes_dims_rope"]), **extra)


def save_layout(model, path, layout, *, to_diffusers, metadata_key, stem, folder_config, max_shard_size=None,
                dtype=None, metadata=None):
    """Save `model` in BFL's layout ("bfl", files `<stem>*.safetensors`) or diffusers' ("diffusers",
    `to_diffusers(state, params)`, diffusion_pytorch_model*.safetensors + `folder_config` as config.json in a folder),
    its params in the metadata under `metadata_key`. `path` ending in .safetensors: one file (or shards of
    max_shard_size bytes plus an index); otherwise a folder. dtype: the floating weights written in it (None: their
    own); metadata: more entries of the files' metadata. Returns the files written."""
    if layout not in ("bfl", "diffusers"):
        raise ValueError(f"layout must be 'bfl' or 'diffusers', got {layout!r}")
    CIO.check_saveable(model, f"saving {type(model).__name__}")
    p = model.params
    with flame.no_grad():
        state = {k: t.detach() for k, t in model.named_parameters()}
        if layout == "diffusers":
            state = to_diffusers(state, p)
    metadata = {**(metadata or {}), "format": "pt", metadata_key: json.dumps(dataclasses.asdict(p))}  # tuples: lists
    diffusers = layout == "diffusers"
    return CIO.save_weights(state.items(), path, stem="diffusion_pytorch_model" if diffusers else stem,
                            metadata=metadata, max_shard_size=max_shard_size,
                            folder_config=folder_config if diffusers else None, dtype=dtype)
