"""Writing checkpoints so that an interrupted save never leaves a half-written file: JSON and safetensors files are
written through flame_core.io.atomic_write (temporary name in the same folder, fsync, rename, fsync of the folder);
large state dicts split into shards with an index JSON as diffusers and transformers write them."""
import os

import numpy as np

from flame_core import Tensor
from flame_core.io import Deferred, save_file, write_json

from .finding import INDEX_SUFFIX


def check_saveable(model, caller):
    """Refuse (ValueError naming `caller`) to save a model whose parameters do not hold its weights as values:
    Linear weights in fp8 storage (their per-row scales are buffers no checkpoint layout of the model has: the file
    would hold the scaled bytes alone, wrong by the scales) or blocks streamed from host memory (their storage is
    the streamer's). Load the model without fp8 / streaming to save it."""
    from flame_nn.offload import is_fp8_linear, streamer_of
    fp8 = [n for n, m in model.named_modules() if is_fp8_linear(m)]
    if fp8:
        raise ValueError(f"{caller}: {len(fp8)} Linear layers store their weights in fp8 (e.g. {fp8[0]}), without "
                         f"a place for their scales in this layout; load the model without fp8 storage to save it")
    streamer = streamer_of(model)
    if streamer is not None and not streamer.weights_on_host:   # (inside on_host its tensors hold the weights)
        raise ValueError(f"{caller}: the blocks are streamed from host memory; load the model without streaming "
                         f"to save it, or save inside streamer.on_host()")


def cast_item(t, dtype):
    """Tensor `t` as written in `dtype` (a flame dtype; None: its own): a floating tensor of another floating dtype
    becomes an io.Deferred that casts it when its turn to be written comes (one tensor's copy at a time, on its
    device); anything else is returned as it is."""
    if dtype is None or not isinstance(t, Tensor) or t.dtype == dtype or not t.dtype.is_floating_point:
        return t
    return Deferred(dtype.np, tuple(t.shape), lambda: t.detach().to(dtype))


def other_tensors(path, skip_prefix):
    """[(key, io.Deferred)] of every tensor of the .safetensors file `path` whose key does not start with
    `skip_prefix`, each read from the file when its turn to be written comes (copied bit for bit, one at a time): the
    parts of a single-file checkpoint beside the one a caller writes anew (an SAI file's VAE and text encoders beside
    a trained UNet). [] when `path` is not a .safetensors file or `skip_prefix` is empty (a bare part file)."""
    from flame_core.io import safe_open
    path = os.fspath(path) if path is not None else ""
    if not skip_prefix or not path.endswith(".safetensors") or not os.path.isfile(path):
        return []

    def read(key):
        with safe_open(path) as f:
            return f.get_array(key)
    with safe_open(path) as f:
        return [(k, Deferred(f.dtype(k), f.shape(k), lambda k=k: read(k))) for k in f.keys()
                if not k.startswith(skip_prefix)]


def _nbytes(t):
    return t.nbytes if not isinstance(t, Deferred) else int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize


def shard_groups(items, max_shard_size):
    """[(key, tensor)] split into consecutive groups of at most `max_shard_size` bytes (None: one group; a tensor
    larger than the limit gets a group of its own)."""
    groups, current, size = [], [], 0
    for key, t in items:
        n = _nbytes(t)
        if current and max_shard_size is not None and size + n > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append((key, t))
        size += n
    if current:
        groups.append(current)
    return groups


def save_shards(items, folder, stem, *, metadata=None, max_shard_size=None, dtype=None):
    """Write [(key, tensor)] as `folder`/`stem`.safetensors, or, when max_shard_size splits them, as
    `stem`-0000i-of-0000n.safetensors plus `stem`.safetensors.index.json (its weight_map and total size). Every
    file is written atomically. dtype: floating tensors written in it (cast_item). Returns the paths written, the
    index last."""
    items = [(k, cast_item(t, dtype)) for k, t in items]
    groups = shard_groups(items, max_shard_size)
    if len(groups) <= 1:
        out = os.path.join(folder, stem + ".safetensors")
        save_file(dict(items), out, metadata=metadata)
        return [out]
    files, weight_map = [], {}
    for i, group in enumerate(groups):
        name = f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(dict(group), os.path.join(folder, name), metadata=metadata)
        files.append(os.path.join(folder, name))
        weight_map.update({k: name for k, _ in group})
    index = os.path.join(folder, stem + INDEX_SUFFIX)
    write_json(index, {"metadata": {"total_size": sum(_nbytes(t) for _, t in items)}, "weight_map": weight_map})
    return files + [index]


def save_weights(items, path, *, stem, metadata=None, max_shard_size=None, folder_config=None, dtype=None):
    """Save [(key, tensor)] at `path`: a path ending in .safetensors names the file (sharded: `path`'s stem names the
    shards and the index); any other path is a folder, created if needed, that gets `stem`.safetensors (or shards
    and an index, see save_shards) and, when `folder_config` is given, that dict as config.json. Returns the weight
    files written, the index last. dtype: floating tensors written in it (cast_item; None: their own)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        return save_shards(items, os.path.dirname(path) or ".", os.path.basename(path)[:-len(".safetensors")],
                           metadata=metadata, max_shard_size=max_shard_size, dtype=dtype)
    os.makedirs(path, exist_ok=True)
    written = save_shards(items, path, stem, metadata=metadata, max_shard_size=max_shard_size, dtype=dtype)
    if folder_config is not None:
        write_json(os.path.join(path, "config.json"), folder_config)
    return written
