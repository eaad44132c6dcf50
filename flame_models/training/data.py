"""Training data for Flux LoRA: precomputed samples (VAE latents + text embeddings) and a reproducible loader.

A sample is a dict of NumPy arrays:
    latents               (16, H/8, W/8)   VAE latents, already scaled ((z − 0.1159)·0.3611, as Flux trains on)
    prompt_embeds         (L, 4096)        T5-XXL hidden states of the caption
    pooled_prompt_embeds  (768,)           CLIP-L pooled embedding
`FolderDataset` reads one .safetensors file per sample (those three keys) and checks every file's header up front;
`SyntheticDataset` makes samples from a seed: smooth latent patterns per class, each class with its own caption
embedding, so a model can learn which caption goes with which picture (the loss has something to fall towards).
`Loader` yields batches in a per-epoch shuffled order that depends only on (seed, epoch): its state (epoch, index)
is all a checkpoint needs to continue with exactly the same batches.
"""
import os

import numpy as np

from flame_core.errors import FlameError

KEYS = ("latents", "prompt_embeds", "pooled_prompt_embeds")
LATENT_CHANNELS = 16


class DatasetError(FlameError, ValueError):
    """A dataset folder or file that cannot be used (the message names the files and keys)."""


class FolderDataset:
    def __init__(self, folder, context_dim=None, vec_dim=None, num_repeats=1):
        from flame_core import io
        if not os.path.isdir(folder):
            raise DatasetError(f"dataset folder not found: {folder}")
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise DatasetError(f"{folder} holds no .safetensors files (one per sample, with keys {', '.join(KEYS)})")
        self.files = [os.path.join(folder, f) for f in files] * int(num_repeats)
        problems, self.shapes = [], []
        for path in self.files[:len(files)]:
            try:
                with io.safe_open(path) as f:
                    keys = set(f.keys())
                    missing = [k for k in KEYS if k not in keys]
                    if missing:
                        problems.append(f"{os.path.basename(path)}: missing {missing} (has {sorted(keys)})")
                        continue
                    shapes = {k: tuple(f.shape(k)) for k in KEYS}
            except Exception as e:  # a corrupt or non-safetensors file
                problems.append(f"{os.path.basename(path)}: {e}")
                continue
            err = _check_shapes(shapes, context_dim, vec_dim)
            if err:
                problems.append(f"{os.path.basename(path)}: {err}")
            self.shapes.append(shapes)
        if problems:
            raise DatasetError(f"{folder}: {len(problems)} unusable file(s):\n  " + "\n  ".join(problems[:20])
                               + ("\n  ..." if len(problems) > 20 else ""))
        self.shapes = self.shapes * int(num_repeats)

    def __len__(self):
        return len(self.files)

    def latent_shape(self, i):
        return self.shapes[i]["latents"]

    def __getitem__(self, i):
        from flame_core import io
        with io.safe_open(self.files[i]) as f:
            return {k: f.get_array(k).astype(np.float32) for k in KEYS}


def _check_shapes(shapes, context_dim, vec_dim):
    lat, txt, pooled = shapes["latents"], shapes["prompt_embeds"], shapes["pooled_prompt_embeds"]
    if len(lat) != 3 or lat[0] != LATENT_CHANNELS or lat[1] % 2 or lat[2] % 2:
        return f"latents {lat}: expected ({LATENT_CHANNELS}, h, w) with even h and w"
    if len(txt) != 2 or (context_dim is not None and txt[1] != context_dim):
        return f"prompt_embeds {txt}: expected (L, {context_dim or 'context_dim'})"
    if len(pooled) != 1 or (vec_dim is not None and pooled[0] != vec_dim):
        return f"pooled_prompt_embeds {pooled}: expected ({vec_dim or 'vec_dim'},)"
    return None


def write_sample(path, latents, prompt_embeds, pooled_prompt_embeds):
    """Write one sample file in the folder format (float32 arrays; bf16 is accepted as well)."""
    from flame_core import io
    io.save_file({"latents": np.asarray(latents), "prompt_embeds": np.asarray(prompt_embeds),
                  "pooled_prompt_embeds": np.asarray(pooled_prompt_embeds)}, path)


class SyntheticDataset:
    """`num_samples` samples in `num_classes` classes. Class k: a smooth latent pattern (a coarse Gaussian field
    upsampled) and a caption embedding; each sample adds a little noise to both."""

    def __init__(self, num_samples=16, height=128, width=128, text_length=16, context_dim=4096, vec_dim=768,
                 num_classes=4, seed=0, noise=0.1):
        if height % 16 or width % 16:
            raise DatasetError(f"synthetic image size must be a multiple of 16, got {height}x{width}")
        rng = np.random.default_rng(seed)
        h, w = height // 8, width // 8
        coarse = rng.standard_normal((num_classes, LATENT_CHANNELS, max(h // 4, 1), max(w // 4, 1)))
        protos = np.stack([_upsample(c, h, w) for c in coarse])
        protos /= protos.std(axis=(1, 2, 3), keepdims=True)
        cls_txt = rng.standard_normal((num_classes, text_length, context_dim))
        cls_vec = rng.standard_normal((num_classes, vec_dim))
        self.labels = np.arange(num_samples) % num_classes
        self.items = []
        for i, k in enumerate(self.labels):
            self.items.append({
                "latents": (protos[k] + noise * rng.standard_normal(protos[k].shape)).astype(np.float32),
                "prompt_embeds": (cls_txt[k] + noise * rng.standard_normal(cls_txt[k].shape)).astype(np.float32),
                "pooled_prompt_embeds": (cls_vec[k] + noise * rng.standard_normal(vec_dim)).astype(np.float32)})

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


class Loader:
    """Batches of `batch_size` samples in an order shuffled per epoch from (seed, epoch). Iterating never ends;
    `state_dict()` = {epoch, index} restores the exact position. Samples in a batch must share their shapes."""

    def __init__(self, dataset, batch_size=1, shuffle=True, seed=0):
        if len(dataset) < batch_size:
            raise DatasetError(f"the dataset has {len(dataset)} samples, fewer than batch_size {batch_size}")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, int(batch_size), bool(shuffle), int(seed)
        self.epoch, self.index = 0, 0
        self._order = None

    def _order_for(self, epoch):
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = None

    def next_batch(self):
        """A dict of stacked arrays (B, ...) plus 'indices'."""
        if self._order is None:
            self._order = self._order_for(self.epoch)
        if self.index + self.batch_size > len(self._order):  # drop the ragged tail: every batch is full
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._order_for(self.epoch)
        idx = self._order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        items = [self.dataset[int(i)] for i in idx]
        shapes = {tuple(it["latents"].shape) for it in items}
        if len(shapes) > 1 or len({tuple(it["prompt_embeds"].shape) for it in items}) > 1:
            raise DatasetError(f"a batch mixes sample shapes {sorted(shapes)} (samples {list(map(int, idx))}); "
                               f"use batch_size 1 for datasets of several resolutions")
        batch = {k: np.stack([it[k] for it in items]) for k in KEYS}
        batch["indices"] = np.asarray(idx)
        return batch
