"""Which safetensors files hold a checkpoint: a .safetensors file, a sharded checkpoint's index JSON, a model folder
(diffusers / transformers: config.json next to one weights file or shards + index) or a diffusers pipeline folder
(the model in its subfolder: transformer/, unet/, vae/ ...). Headers only: no tensor is read here.

Each function raises `error` (a CheckpointError subclass the caller names) with the path and what is wrong."""
import json
import os

from .errors import CheckpointError

INDEX_SUFFIX = ".safetensors.index.json"
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


def read_json(path, error=CheckpointError):
    """The parsed JSON file at `path`; `error` naming the file when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot read it as JSON ({e})") from None


def read_config_json(folder, error=CheckpointError):
    """The object in `folder`/config.json, or None when there is no such file or it holds no JSON object."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    config = read_json(path, error)
    return config if isinstance(config, dict) else None


def check_not_pickle(path, error=CheckpointError):
    """Refuse a pickle checkpoint (.ckpt / .pt / .pth / .bin) by its name: unpickling can run code, so it is
    never opened here."""
    if os.fspath(path).lower().endswith(PICKLE_SUFFIXES):
        raise error(f"{path}: only safetensors files are read (convert .ckpt / .pt / .pth / .bin first)")


def index_files(index_path, error=CheckpointError):
    """The shard files a `*.safetensors.index.json` lists in its weight_map, in order of first mention; `error`
    when the index is unreadable, its weight_map empty or a shard absent."""
    index = read_json(index_path, error)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise error(f"{index_path}: an index JSON needs a non-empty 'weight_map'")
    folder = os.path.dirname(index_path)
    files = [os.path.join(folder, n) for n in dict.fromkeys(weight_map.values())]
    absent = [f for f in files if not os.path.exists(f)]
    if absent:
        raise error(f"{index_path}: shard(s) listed in the index are missing: {', '.join(absent[:4])}"
                    + (f" and {len(absent) - 4} more" if len(absent) > 4 else ""))
    return files


def pipeline_subfolder(folder, name):
    """`folder`/`name` when `folder` is a diffusers pipeline folder holding the model there (it has that subfolder
    and no weights of its own), else `folder`."""
    sub = os.path.join(folder, name)
    if os.path.isdir(sub) and not any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in os.listdir(folder)):
        return sub
    return folder


def folder_weights(folder, error=CheckpointError, *, preferred=None):
    """The weights files of the one model in `folder`: the shards its index JSON lists, else `preferred` (such as
    diffusers' diffusion_pytorch_model.safetensors) when present, else its only .safetensors file."""
    names = os.listdir(folder)
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise error(f"{folder}: several index files ({', '.join(indexes)}); pass one of them")
    if indexes:
        return index_files(os.path.join(folder, indexes[0]), error)
    files = sorted(n for n in names if n.endswith(".safetensors"))
    if preferred in files:
        files = [preferred]
    if len(files) != 1:
        raise error(f"{folder}: expected " + (f"{preferred}, " if preferred else "") + "one .safetensors file or an "
                    f"index JSON, found {len(files)} safetensors files"
                    + (f" ({', '.join(files[:6])}): pass the file" if files else ""))
    return [os.path.join(folder, files[0])]


def safetensors_files(path, *, what, error=CheckpointError, subfolder=None, preferred=None):
    """The safetensors files of the `what` checkpoint at `path` (e.g. what="Flux"): a .safetensors file, an index
    JSON (its shards), or a folder holding either (a pipeline folder's `subfolder` too, see pipeline_subfolder).
    FileNotFoundError when nothing is at `path`; `error` for a pickle, a broken index or a folder without one clear
    set of weights."""
    path = os.fspath(path)
    if os.path.isdir(path):
        folder = pipeline_subfolder(path, subfolder) if subfolder else path
        return folder_weights(folder, error, preferred=preferred)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {what} checkpoint at {path}")
    check_not_pickle(path, error)
    if path.endswith(".json"):
        return index_files(path, error)
    return [path]
