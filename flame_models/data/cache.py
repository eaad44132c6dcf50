"""Caches of VAE latents and text embeddings: one safetensors file per entry, named by a hash of its content and
of the encoder's identity, so that a changed image, caption, bucket/crop or model gets a new name - and exactly
those entries are encoded again, nothing else.

    latents = LatentCache(encoder_id=f"flux-vae|{vae_file}|{size}|{mtime}|bfloat16")
    latents.fill(dataset.latent_specs(), encode_images, batch_size=4)   # VAE loaded only for this
    texts = TextEmbeddingCache(folder, encoder_id="t5xxl|...|clip_l|...|bfloat16")
    texts.fill(dataset.prompts(range(epochs)) + sample_prompts, encode_prompts, batch_size=8)

`encoder_id` is the caller's string for "the same encoder gives the same output": e.g. the weight files' names,
sizes and modification times, the dtype, and any scale/shift applied inside the encoder callable. The caches store
what the callables return, verbatim.

Latent key = sha256(encoder_id, the image file's sha256, the placement: bucket, resize, crop, flips, resize filter,
background). Text key = sha256(encoder_id, the caption string). A folder of None keeps entries in host memory
(for the run only). Each file is written temp -> fsync -> rename (flame_core.io.save_file), right after its batch
is encoded: an interrupted fill leaves only whole files, and the next fill encodes only what is missing. Each file
carries the SHA-256 of its arrays (metadata "sha256"): an entry whose arrays do not match it (a damaged or edited
file), hold NaN / inf, or have no checksum (written by an older FLAME) counts as missing and is encoded again; one
damaged after the fill is refused when read, naming the file. An encoder that returns NaN / inf is an error naming
the image or caption (nothing non-finite is cached). Files
that no current entry uses (an edited image's old latents, another model's) are left where they are: switching
back costs nothing; `prune(...)` deletes them on request.
"""
import hashlib
import json
import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import DataError

_NAME = re.compile(r"^[0-9a-f]{64}\.safetensors$")
_TMP = re.compile(r"^[0-9a-f]{64}\.safetensors\..*\.tmp$")


def _digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def checksum(arrays):
    """SHA-256 (hex) of {name: array}: names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
    return h.hexdigest()


def _problem(path):
    """(arrays, None) of an intact cache file, or (None, why not)."""
    from flame_core import io
    try:
        with io.safe_open(path) as f:
            want = (f.metadata() or {}).get("sha256")
            arrays = {k: f.get_array(k) for k in list(f.keys())}
    except Exception as ex:  # noqa: BLE001 - an unreadable file (e.g. copied in half) is encoded again
        return None, f"unreadable ({type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''})"
    if want is None:
        return None, "no checksum (written by an older FLAME)"
    if checksum(arrays) != want:
        return None, "its arrays do not match their SHA-256 (damaged)"
    for k, a in arrays.items():
        if a.dtype.kind == "f" and not np.isfinite(a.astype(np.float32) if a.dtype.itemsize < 4 else a).all():
            return None, f"{k} holds NaN or infinite values"
    return arrays, None


def _finite(arrays, what):
    for k, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind == "f" and not np.isfinite(a.astype(np.float32) if a.dtype.itemsize < 4 else a).all():
            raise DataError(f"{what}: the encoder returned NaN or infinite values in {k!r}; nothing was cached "
                            f"(check the file, or encode in a wider dtype)")


def _numpy(x, what):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy"):
        return x.numpy()
    try:
        return np.asarray(x)
    except Exception:
        raise DataError(f"{what}: expected an array, got {type(x).__name__}") from None


class _Store:
    """key -> {name: array}: files in `folder`, or a dict when `folder` is None."""

    def __init__(self, folder):
        self.folder = folder
        self.memory = {} if folder is None else None

    def path(self, key):
        return os.path.join(self.folder, key + ".safetensors")

    def has(self, key):
        if self.memory is not None:
            return key in self.memory
        path = self.path(key)
        if not os.path.isfile(path):
            return False
        return _problem(path)[1] is None  # damaged, non-finite or unchecked: encoded again

    def write(self, key, arrays, metadata):
        if self.memory is not None:
            self.memory[key] = {k: np.array(v) for k, v in arrays.items()}
            return
        from flame_core import io
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        io.save_file(arrays, self.path(key), metadata={**metadata, "sha256": checksum(arrays)})

    def read(self, key, what):
        if self.memory is not None:
            if key not in self.memory:
                raise DataError(f"{what}: not in the in-memory cache; run the caching stage first")
            return self.memory[key]
        path = self.path(key)
        if not os.path.isfile(path):
            raise DataError(f"{what}: cache file {path} is missing; run the caching stage again")
        arrays, why = _problem(path)
        if why is not None:
            raise DataError(f"{what}: cache file {path}: {why}; run again to encode it again")
        return arrays

    def read_array(self, key, name, what):
        """One array of an entry, or None when the entry has no `name` (a file: read alone, unchecked -- `read`
        checks the whole entry when a batch loads it)."""
        if self.memory is not None:
            if key not in self.memory:
                raise DataError(f"{what}: not in the in-memory cache; run the caching stage first")
            return self.memory[key].get(name)
        from flame_core import io
        path = self.path(key)
        try:
            with io.safe_open(path) as f:
                return f.get_array(name) if name in f.keys() else None
        except (OSError, ValueError) as ex:
            raise DataError(f"{what}: cache file {path} is unreadable ({type(ex).__name__}: {ex}); run the caching "
                            f"stage again") from ex

    def prune(self, keep):
        if self.memory is not None:
            for k in [k for k in self.memory if k not in keep]:
                del self.memory[k]
            return 0
        if not os.path.isdir(self.folder):
            return 0
        removed = 0
        for name in os.listdir(self.folder):
            if (_NAME.match(name) and name[:64] not in keep) or _TMP.match(name):
                os.unlink(os.path.join(self.folder, name))
                removed += 1
        return removed

    def check_writable(self):
        if self.memory is not None:
            return
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as ex:
            raise DataError(f"cannot create the cache folder {self.folder}: {ex.strerror or ex}") from None
        if not os.access(self.folder, os.W_OK):
            raise DataError(f"the cache folder {self.folder} is not writable")


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _bar(total, desc, enabled):
    """A tqdm progress bar, or a stand-in that shows nothing (not `enabled`, or no tqdm)."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="item", dynamic_ncols=True)


class LatentCache:
    """VAE latents per LatentSpec (dataset.latent_spec): files in each spec's `folder`, or host memory."""

    def __init__(self, encoder_id):
        if not isinstance(encoder_id, str) or not encoder_id:
            raise DataError(f"LatentCache: encoder_id must be a non-empty string, got {encoder_id!r}")
        self.encoder_id = encoder_id
        self._stores = {}
        self.encoded = 0          # entries encoded by this object (fills counted together)

    def _store(self, folder):
        if folder not in self._stores:
            self._stores[folder] = _Store(folder)
        return self._stores[folder]

    def key(self, spec):
        return _digest({"encoder": self.encoder_id, "image": spec.sha256, "params": spec.params()})

    def missing(self, specs):
        """The specs (one per distinct key and cache folder) that have no cached entry. The same image in two
        datasets has one key but an entry in each dataset's folder (or in memory)."""
        seen, out = set(), []
        for s in specs:
            k = self.key(s)
            if (s.folder, k) not in seen:
                seen.add((s.folder, k))
                if not self._store(s.folder).has(k):
                    out.append(s)
        return out

    def fill(self, specs, encode_images, batch_size=4, progress=True, workers=None):
        """Encode every spec not cached yet, `batch_size` images of one bucket per call of
        `encode_images((B, 3, H, W) float32 in [-1, 1]) -> (B, C, H/f, W/f)`; returns how many were encoded.
        Images are decoded and resized by `workers` threads (default: up to 4) two batches ahead of the encoder."""
        todo = self.missing(specs)
        for folder in {s.folder for s in todo}:
            self._store(folder).check_writable()
        groups = {}
        for s in todo:
            groups.setdefault(s.bucket, []).append(s)
        chunks = [g[j:j + batch_size] for _, g in sorted(groups.items()) for j in range(0, len(g), batch_size)]
        workers = workers or min(4, os.cpu_count() or 1)
        bar = _bar(len(todo), "Caching latents", progress and bool(todo))
        pool = ThreadPoolExecutor(workers) if chunks else None
        pending, upcoming, done = deque(), iter(chunks), 0

        def submit():
            chunk = next(upcoming, None)
            if chunk is not None:
                pending.append((chunk, [pool.submit(s.pixels) for s in chunk]))

        try:
            for _ in range(2):
                submit()
            while pending:
                chunk, futures = pending.popleft()
                submit()
                pixels = np.stack([f.result() for f in futures])               # (B, 3, H, W)
                out = _numpy(encode_images(pixels), "encode_images")
                if out.ndim != 4 or out.shape[0] != len(chunk):
                    raise DataError(f"encode_images returned shape {tuple(out.shape)} for input "
                                    f"{tuple(pixels.shape)}; expected ({len(chunk)}, C, h, w)")
                for s, lat in zip(chunk, out):
                    _finite({"latents": lat}, f"latents of {s.path} ({s.bucket})")
                    self._store(s.folder).write(self.key(s), {"latents": lat}, {
                        "format": "flame-latent-cache/1", "encoder_id": self.encoder_id, "image": s.path,
                        "params": json.dumps(s.params(), sort_keys=True)})
                done += len(chunk)
                self.encoded += len(chunk)
                bar.update(len(chunk))
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
        return done

    def load(self, spec):
        """The cached latents (C, h, w) of `spec`."""
        return self._store(spec.folder).read(self.key(spec), f"latents of {spec.path} ({spec.bucket})")["latents"]

    def prune(self, specs):
        """Delete cached latents (in the folders `specs` use) that none of `specs` needs; returns the count."""
        keep = {}
        for s in specs:
            keep.setdefault(s.folder, set()).add(self.key(s))
        return sum(self._store(folder).prune(k) for folder, k in keep.items())


class TextEmbeddingCache:
    """Text-encoder outputs per caption string: files in `folder`, or host memory when it is None."""

    def __init__(self, folder, encoder_id):
        if not isinstance(encoder_id, str) or not encoder_id:
            raise DataError(f"TextEmbeddingCache: encoder_id must be a non-empty string, got {encoder_id!r}")
        self.encoder_id, self.store = encoder_id, _Store(folder)
        self.encoded = 0

    def key(self, prompt):
        return _digest({"encoder": self.encoder_id, "prompt": prompt})

    def missing(self, prompts):
        return [p for p in dict.fromkeys(prompts) if not self.store.has(self.key(p))]

    def fill(self, prompts, encode_prompts, batch_size=8, progress=True):
        """Encode every prompt not cached yet, `batch_size` per call of `encode_prompts(list of str) ->
        {name: (B, ...) array}`; returns how many were encoded."""
        for p in prompts:
            if not isinstance(p, str):
                raise DataError(f"TextEmbeddingCache.fill: prompts must be strings, got {type(p).__name__} {p!r}")
        todo = self.missing(prompts)
        if todo:
            self.store.check_writable()
        bar = _bar(len(todo), "Caching text embeddings", progress and bool(todo))
        done = 0
        try:
            for j in range(0, len(todo), batch_size):
                chunk = todo[j:j + batch_size]
                out = encode_prompts(list(chunk))
                if not isinstance(out, dict) or not out:
                    raise DataError(f"encode_prompts must return a non-empty dict of name -> array, got "
                                    f"{type(out).__name__}")
                arrays = {k: _numpy(v, f"encode_prompts[{k!r}]") for k, v in out.items()}
                for k, v in arrays.items():
                    if v.ndim < 1 or v.shape[0] != len(chunk):
                        raise DataError(f"encode_prompts returned {k!r} of shape {tuple(v.shape)} for "
                                        f"{len(chunk)} prompts; expected ({len(chunk)}, ...)")
                for i, p in enumerate(chunk):
                    _finite({k: v[i] for k, v in arrays.items()}, f"text embeddings of {p[:60]!r}")
                    self.store.write(self.key(p), {k: v[i] for k, v in arrays.items()}, {
                        "format": "flame-text-cache/1", "encoder_id": self.encoder_id, "prompt": p})
                done += len(chunk)
                self.encoded += len(chunk)
                bar.update(len(chunk))
        finally:
            bar.close()
        return done

    def load(self, prompt):
        """{name: array} of `prompt` (each without the batch dimension)."""
        shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
        return self.store.read(self.key(prompt), f"text embeddings of {shown!r}")

    def load_array(self, prompt, name):
        """The array `name` of `prompt`'s entry alone (None when the encoder made none of that name)."""
        shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
        return self.store.read_array(self.key(prompt), name, f"text embeddings of {shown!r}")

    def prune(self, prompts):
        return self.store.prune({self.key(p) for p in prompts})
