"""Training data as precomputed samples (latents + conditioning arrays) and a reproducible loader.

A sample is a dict of NumPy arrays whose keys are the model family's `sample_keys`: "latents" (C, h, w) -- VAE
latents already normalised as the model trains on them -- then the conditioning (Flux: prompt_embeds (L, 4096),
pooled_prompt_embeds (768,)). `FolderDataset` reads one .safetensors file per sample and checks every file's header
up front (`scan_folder`, which config validation runs before any model is built); `SyntheticDataset` makes samples
from a seed: smooth latent patterns per class, each class with its own conditioning, so a model can learn which
conditioning goes with which picture. `Loader` yields batches in an order that depends only on (seed, epoch): its
state (epoch, index) is all a checkpoint needs to continue with exactly the same batches.
"""
import os

import numpy as np

from flame_core import io
from flame_core.errors import FlameError


class DatasetError(FlameError, ValueError):
    """A dataset folder or file that cannot be used (the message names the files and keys)."""


def dataset_kind(folder):
    """'images' for a folder with images (searched as ImageDataset does), 'samples' for one of precomputed
    .safetensors samples only, None when it is neither (or missing)."""
    from ..data.config import IMAGE_EXTENSIONS
    from ..data.walk import walk_files
    if not os.path.isdir(folder):
        return None
    if any(f.lower().endswith(IMAGE_EXTENSIONS) for f in walk_files(folder)):   # (links: the data walk's policy)
        return "images"
    return "samples" if any(f.endswith(".safetensors") for f in walk_files(folder, recursive=False)) else None


def scan_folder(folder, keys, check=None, warn=None):
    """(files, shapes, problems) of a folder of per-sample .safetensors: every file's header is read (no tensor),
    its `keys` must be present, and `check(shapes)` (None or a message) must accept their shapes. Symbolic links:
    the data walk's policy (flame_models/data/walk.py; links skipped go to warn(message))."""
    from ..data.walk import walk_files
    if not os.path.isdir(folder):
        return [], [], [f"no such folder: {folder}"]
    files = [f for f in walk_files(folder, warn, recursive=False) if f.endswith(".safetensors")]
    if not files:
        return [], [], [f"{folder} holds no .safetensors files (one per sample, with keys {', '.join(keys)})"]
    problems, shapes = [], []
    for path in files:
        name = os.path.basename(path)
        try:
            with io.safe_open(path) as f:
                have = set(f.keys())
                missing = [k for k in keys if k not in have]
                if missing:
                    problems.append(f"{name}: missing {missing} (has {sorted(have)})")
                    continue
                s = {k: tuple(f.shape(k)) for k in keys}
        except Exception as e:  # noqa: BLE001 - a corrupt or non-safetensors file is reported, not raised
            problems.append(f"{name}: not a readable .safetensors file ({type(e).__name__}: {e})")
            continue
        err = check(s) if check is not None else None
        if err:
            problems.append(f"{name}: {err}")
        shapes.append(s)
    return files, shapes, problems


def _listing(folder, problems):
    return (f"{folder}: {len(problems)} unusable file(s): " + "; ".join(problems[:20])
            + ("; ..." if len(problems) > 20 else ""))


class FolderDataset:
    """One sample per .safetensors file of `folder` (each with `keys`), repeated `num_repeats` times."""

    def __init__(self, folder, keys, check=None, num_repeats=1):
        self.warnings = []
        files, shapes, problems = scan_folder(folder, keys, check, self.warnings.append)
        if problems:
            raise DatasetError(_listing(folder, problems))
        self.folder, self.keys = folder, tuple(keys)
        self.files = files * int(num_repeats)
        self.shapes = shapes * int(num_repeats)

    def __len__(self):
        return len(self.files)

    def latent_shape(self, i):
        return self.shapes[i]["latents"]

    def __getitem__(self, i):
        with io.safe_open(self.files[i]) as f:
            return {k: f.get_array(k).astype(np.float32) for k in self.keys}


def write_sample(path, **arrays):
    """Write one sample file in the folder format, e.g. write_sample(p, latents=..., prompt_embeds=..., ...)."""
    io.save_file({k: np.asarray(v) for k, v in arrays.items()}, path)


class SyntheticDataset:
    """`num_samples` samples in `num_classes` classes. Class k: a smooth latent pattern (a coarse Gaussian field
    upsampled) and one array per conditioning key; each sample adds a little noise to all of them.

    conditioning: {key: shape} of the conditioning arrays of one sample (the family's synthetic_conditioning)."""

    def __init__(self, num_samples=16, height=128, width=128, conditioning=None, latent_channels=16,
                 vae_scale_factor=8, num_classes=4, seed=0, noise=0.1):
        f = vae_scale_factor
        if height % (2 * f) or width % (2 * f):
            raise DatasetError(f"synthetic image size must be a multiple of {2 * f}, got {height}x{width}")
        conditioning = dict(conditioning or {})
        rng = np.random.default_rng(seed)
        h, w = height // f, width // f
        coarse = rng.standard_normal((num_classes, latent_channels, max(h // 4, 1), max(w // 4, 1)))
        protos = np.stack([_upsample(c, h, w) for c in coarse])
        protos /= protos.std(axis=(1, 2, 3), keepdims=True)
        cls = {k: rng.standard_normal((num_classes,) + tuple(s)) for k, s in conditioning.items()}
        self.labels = np.arange(num_samples) % num_classes
        self.items = []
        for k in self.labels:
            item = {"latents": (protos[k] + noise * rng.standard_normal(protos[k].shape)).astype(np.float32)}
            for key, s in conditioning.items():
                item[key] = (cls[key][k] + noise * rng.standard_normal(tuple(s))).astype(np.float32)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def latent_shape(self, i):
        return self.items[i]["latents"].shape

    def __getitem__(self, i):
        return self.items[i]


def _upsample(x, h, w):
    """Bilinear resize (C, h0, w0) -> (C, h, w) (align_corners=True), in NumPy."""
    c, h0, w0 = x.shape
    ys, xs = np.linspace(0, h0 - 1, h), np.linspace(0, w0 - 1, w)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h0 - 1), np.minimum(x0 + 1, w0 - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = x[:, y0][:, :, x0] * (1 - fx) + x[:, y0][:, :, x1] * fx
    bot = x[:, y1][:, :, x0] * (1 - fx) + x[:, y1][:, :, x1] * fx
    return top * (1 - fy) + bot * fy


class ConcatDataset:
    """Several datasets one after the other (`parts` keep their own identity for per-dataset shuffling)."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.warnings = [w for p in self.parts for w in getattr(p, "warnings", [])]
        self._index = [(i, j) for i, p in enumerate(self.parts) for j in range(len(p))]

    def __len__(self):
        return len(self._index)

    def latent_shape(self, k):
        i, j = self._index[k]
        return self.parts[i].latent_shape(j)

    def __getitem__(self, k):
        i, j = self._index[k]
        return self.parts[i][j]


class Loader:
    """Batches of `batch_size` samples; iterating never ends; `state_dict()` = {epoch, index} restores the exact
    position. Samples in a batch must share their shapes.

    shuffle: one flag, or one per part of a ConcatDataset. An epoch's order depends only on (seed, epoch): when any
    part shuffles, the positions of the parts are interleaved at random and each part fills its positions in its
    own order -- permuted when it shuffles, its file order when it does not. With one part and shuffling this is a
    permutation of the whole epoch."""

    def __init__(self, dataset, batch_size=1, shuffle=True, seed=0):
        if len(dataset) < batch_size:
            raise DatasetError(f"the dataset has {len(dataset)} samples, fewer than batch_size {batch_size}")
        parts = getattr(dataset, "parts", None)
        self.sizes = [len(p) for p in parts] if parts else [len(dataset)]
        flags = list(shuffle) if isinstance(shuffle, (list, tuple)) else [bool(shuffle)] * len(self.sizes)
        if len(flags) != len(self.sizes):
            raise DatasetError(f"{len(flags)} shuffle flags for {len(self.sizes)} datasets")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, int(batch_size), flags, int(seed)
        self.epoch, self.index = 0, 0
        self._order = None

    def _order_for(self, epoch):
        n = sum(self.sizes)
        if not any(self.shuffle):
            return np.arange(n)
        rng = np.random.default_rng([self.seed, epoch])
        if len(self.sizes) == 1:
            return rng.permutation(n)
        owner = np.concatenate([np.full(s, i) for i, s in enumerate(self.sizes)])
        rng.shuffle(owner)
        order = np.empty(n, dtype=np.int64)
        start = 0
        for i, (s, sh) in enumerate(zip(self.sizes, self.shuffle)):
            own = start + (rng.permutation(s) if sh else np.arange(s))
            order[owner == i] = own
            start += s
        return order

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = None

    def next_batch(self):
        """A dict of stacked arrays (B, ...) plus 'indices'."""
        return self.collate(self.next_indices())

    def next_indices(self):
        """The dataset indices of the next batch (the position moves on; nothing is loaded)."""
        if self._order is None:
            self._order = self._order_for(self.epoch)
        if self.index + self.batch_size > len(self._order):  # drop the ragged tail: every batch is full
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._order_for(self.epoch)
        idx = self._order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return idx

    def collate(self, idx):
        """The samples `idx` loaded and stacked: a dict of (len(idx), ...) arrays plus 'indices'."""
        items = [self.dataset[int(i)] for i in idx]
        keys = list(items[0])
        for k in keys:
            shapes = sorted({tuple(it[k].shape) for it in items})
            if len(shapes) > 1:
                raise DatasetError(f"a batch mixes {k} shapes {shapes} (samples {list(map(int, idx))}); use "
                                   f"batch_size 1 for datasets of several resolutions")
        batch = {k: np.stack([it[k] for it in items]) for k in keys}
        batch["indices"] = np.asarray(idx)
        return batch
