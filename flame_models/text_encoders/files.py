"""Finding a text encoder's files: a safetensors file, a sharded checkpoint's index JSON, a transformers folder
(config.json + model.safetensors or shards), or a diffusers model folder (its text_encoder / text_encoder_2 /
text_encoder_3 subfolders); and the open files of one checkpoint, read one tensor at a time."""
import json
import os

from flame_core.errors import FlameError
from flame_core.io import safe_open

INDEX_SUFFIX = ".safetensors.index.json"
DIFFUSERS_SUBFOLDERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
MODEL_TYPES = {"clip": ("clip_text_model", "clip"), "t5": ("t5",)}
NAMES = {"clip": "CLIP text model", "t5": "T5 encoder"}


class TextEncoderCheckpointError(FlameError, ValueError):
    """A text encoder checkpoint that cannot be loaded as asked: missing / unexpected / misshaped tensors, another
    model's file, an unreadable layout (the message names the file and the keys)."""


def _config_at(folder):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise TextEncoderCheckpointError(f"{path}: not valid JSON ({e})") from None
    return cfg if isinstance(cfg, dict) else None


def _kind_of(cfg):
    mt = cfg.get("model_type")
    return next((k for k, types in MODEL_TYPES.items() if mt in types), None)


def _fitting_config(folder, kind, *, strict):
    """The folder's config.json when it describes a `kind` model; None when there is none (or, not strict, when it
    describes something else)."""
    cfg = _config_at(folder)
    if cfg is None:
        return None
    other = _kind_of(cfg)
    if other == kind:
        return cfg
    if strict:
        what = NAMES.get(other) or f"a model of type {cfg.get('model_type')!r}"
        raise TextEncoderCheckpointError(f"{folder}: its config.json describes {what}, not a {NAMES[kind]}")
    return None


def resolve(path, kind, subfolder=None):
    """(safetensors files, config dict or None) of the `kind` ("clip" or "t5") checkpoint at `path`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {NAMES[kind]} checkpoint at {path}")
    if os.path.isdir(path):
        if subfolder is not None:
            sub = os.path.join(path, subfolder)
            if not os.path.isdir(sub):
                raise TextEncoderCheckpointError(f"{path} has no subfolder {subfolder!r}")
            return _folder(sub, kind)
        if os.path.isfile(os.path.join(path, "model_index.json")):
            return _folder(_diffusers_subfolder(path, kind), kind)
        return _folder(path, kind)
    if subfolder is not None:
        raise TextEncoderCheckpointError(f"subfolder={subfolder!r} given but {path} is a file, not a folder")
    if path.endswith(".json"):
        return _index(path), _fitting_config(os.path.dirname(path) or ".", kind, strict=True)
    return [path], _fitting_config(os.path.dirname(os.path.abspath(path)), kind, strict=False)


def _diffusers_subfolder(root, kind):
    """The subfolder of a diffusers model folder that holds the `kind` text encoder: text_encoder for CLIP (pass
    subfolder="text_encoder_2" for SDXL's CLIP-G), the one whose config says T5 for T5."""
    present = [s for s in DIFFUSERS_SUBFOLDERS if os.path.isdir(os.path.join(root, s))]
    if kind == "clip":
        if "text_encoder" in present:
            return os.path.join(root, "text_encoder")
    else:
        for s in reversed(present):
            cfg = _config_at(os.path.join(root, s))
            if cfg is not None and _kind_of(cfg) == "t5":
                return os.path.join(root, s)
    raise TextEncoderCheckpointError(f"{root} is a diffusers model folder without a {NAMES[kind]} "
                                     f"(text encoder subfolders: {', '.join(present) or 'none'}); pass subfolder=")


def _folder(folder, kind):
    cfg = _fitting_config(folder, kind, strict=True)
    indexes = sorted(n for n in os.listdir(folder) if n.endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise TextEncoderCheckpointError(f"{folder}: several index files ({', '.join(indexes)}); pass one of them")
    if indexes:
        return _index(os.path.join(folder, indexes[0])), cfg
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if "model.safetensors" in files:
        files = ["model.safetensors"]
    if len(files) != 1:
        raise TextEncoderCheckpointError(
            f"{folder}: expected model.safetensors, one .safetensors file or an index JSON, found "
            + (f"{len(files)} safetensors files ({', '.join(files[:6])}): pass the file" if files else "none"))
    return [os.path.join(folder, files[0])], cfg


def _index(path):
    try:
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise TextEncoderCheckpointError(f"{path}: not a safetensors index JSON ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise TextEncoderCheckpointError(f"{path}: an index JSON needs a non-empty 'weight_map'")
    folder = os.path.dirname(path)
    files = [os.path.join(folder, n) for n in dict.fromkeys(weight_map.values())]
    absent = [f for f in files if not os.path.exists(f)]
    if absent:
        raise TextEncoderCheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(absent)}")
    return files


class Checkpoint:
    """Open safetensors files of one checkpoint and the index of their keys (nothing read until asked)."""

    def __init__(self, files, label):
        self.label = label
        self.handles = []
        self.where = {}
        try:
            for f in files:
                h = safe_open(f)
                self.handles.append(h)
                for k in h.keys():
                    if k in self.where:
                        raise TextEncoderCheckpointError(f"{label}: tensor {k!r} appears in two files, "
                                                         f"{self.where[k].filename} and {h.filename}")
                    self.where[k] = h
        except BaseException:
            self.close()
            raise

    def keys(self):
        return self.where.keys()

    def shape(self, key):
        return tuple(self.where[key].shape(key))

    def dtype(self, key):
        """The NumPy dtype stored (ml_dtypes for bfloat16 / float8)."""
        return self.where[key].dtype(key)

    def metadata(self, key):
        """The value of `key` in the files' safetensors metadata (the first file that has it), or None."""
        for h in self.handles:
            value = (h.metadata() or {}).get(key)
            if value is not None:
                return value
        return None

    def get(self, key, dtype=None, device=None):
        return self.where[key].get_tensor(key, dtype=dtype, device=device)

    def close(self):
        for h in self.handles:
            h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
