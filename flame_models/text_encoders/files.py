"""Finding a text encoder's files: a safetensors file, a sharded checkpoint's index JSON, a transformers folder
(config.json + model.safetensors or shards), or a diffusers model folder (its text_encoder / text_encoder_2 /
text_encoder_3 subfolders); and the open files of one checkpoint, read one tensor at a time."""
import os

from .. import checkpoint_io as CIO

INDEX_SUFFIX = CIO.INDEX_SUFFIX
DIFFUSERS_SUBFOLDERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
MODEL_TYPES = {"clip": ("clip_text_model", "clip"), "t5": ("t5",)}
NAMES = {"clip": "CLIP text model", "t5": "T5 encoder"}


class TextEncoderCheckpointError(CIO.CheckpointError, ValueError):
    """A text encoder checkpoint that cannot be loaded as asked: missing / unexpected / misshaped tensors, another
    model's file, an unreadable layout (the message names the file and the keys)."""


def _config_at(folder):
    return CIO.read_config_json(folder, TextEncoderCheckpointError)


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
    CIO.check_not_pickle(path, TextEncoderCheckpointError)
    if path.endswith(".json"):
        files = CIO.index_files(path, TextEncoderCheckpointError)
        return files, _fitting_config(os.path.dirname(path) or ".", kind, strict=True)
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
    return CIO.folder_weights(folder, TextEncoderCheckpointError, preferred="model.safetensors"), cfg


class Checkpoint(CIO.SafetensorsCheckpoint):
    """Open safetensors files of one checkpoint and the index of their keys (nothing read until asked); the keys
    are the files' own (a text encoder's prefix is handled by its key map, layouts.py)."""

    error = TextEncoderCheckpointError
