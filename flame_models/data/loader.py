"""Training batches from the caches only (no VAE, no text encoder): a sample's cached latents, the cached text
embeddings of the caption it draws that epoch, and the sizes SDXL's conditioning needs; batches of one bucket.

    train = TrainingDataset(dataset, latent_cache, text_cache)
    train.check(range(loader.sampler.epochs_needed(steps * grad_accum)))   # every entry present, before training
    loader = BucketLoader(train, batch_size=2, shuffle=True, seed=42)
    batch = loader.next_batch()    # {"latents": (B, C, h, w), <embedding names>: (B, ...), "captions": [...],
                                   #  "original_size", "crop_coords", "target_size": (B, 2) int64, "indices", "epoch",
                                   #  "control_latents": (B, C, h, w) when the datasets have control_path,
                                   #  "loss_mask": (B, 1, h, w) float32 when they have masks (masks.py),
                                   #  "is_reg": (B,) bool when they have regularisation images (reg_mix.py),
                                   #  "prior_reg": (B,) bool when a dataset trains toward the adapter-free model,
                                   #  "preserve:<embedding names>" with output preservation}
"""
import numpy as np

from .errors import DataError
from .sampler import BucketBatchSampler
from .text_trim import TextTrim

SIZE_KEYS = ("original_size", "crop_coords", "target_size")
PRESERVATION = "preserve:"   # the prefix of a sample's preservation-prompt embeddings (output preservation)


class TrainingDataset:
    """`masks`: the MaskCache when the datasets have masks; `only`: the sample indices this view draws (None: all;
    the regularisation mix draws its training and its regularisation samples through two views); `text_trim`: the
    run's TextTrim (text_trim.py; planned after the text cache is filled), shared by every view. `preservation`: a
    captions.PreservationPrompt (ai-toolkit's differential or blank prompt output preservation), or None: each
    sample then carries its preservation prompt's embeddings too, under PRESERVATION + their names."""

    def __init__(self, dataset, latents, texts, masks=None, only=None, text_trim=None, preservation=None):
        self.dataset, self.latents, self.texts, self.masks = dataset, latents, texts, masks
        self.preservation = preservation
        self.only = None if only is None else frozenset(int(i) for i in only)
        self.text_trim = TextTrim() if text_trim is None else text_trim   # shared with the views (subset)
        if getattr(dataset, "has_masks", False) and masks is None:
            raise DataError("the datasets have masks (mask_path / alpha_mask): give TrainingDataset their MaskCache")

    def __len__(self):
        return len(self.dataset) if self.only is None else len(self.only)

    def subset(self, indices):
        """A view drawing only the samples `indices` (the same caches)."""
        return TrainingDataset(self.dataset, self.latents, self.texts, self.masks, indices, self.text_trim,
                               self.preservation)

    def buckets(self):
        out = self.dataset.buckets()
        if self.only is None:
            return out
        out = {b: [i for i in idx if i in self.only] for b, idx in out.items()}
        return {b: idx for b, idx in out.items() if idx}

    def check(self, epochs):
        """DataError listing the cache entries that epochs `epochs` would need but that are missing."""
        epochs = list(epochs)
        lat = self.latents.missing(self.dataset.latent_specs())
        txt = self.texts.missing(self.dataset.prompts(epochs) + (
            self.dataset.preservation_prompts(epochs, self.preservation) if self.preservation is not None else []))
        masks = self.masks.missing(self.dataset.mask_specs(self.masks.factor)) if self.masks is not None else []
        if lat or txt or masks:
            shown = ([f"latents of {s.path} at {s.bucket}" for s in lat[:10]] + [f"text of {p!r}" for p in txt[:10]]
                     + [f"mask {s.path} at {s.bucket}" for s in masks[:10]])
            counts = (f"{len(lat)} latent, {len(txt)} text-embedding and {len(masks)} mask" if self.masks is not None
                      else f"{len(lat)} latent and {len(txt)} text-embedding")
            raise DataError(f"{counts} cache entries are missing (fill the caches first):\n  " + "\n  ".join(shown))

    def get(self, i, epoch):
        """One sample as it trains in `epoch`: latents (C, h, w), the caption's embeddings by name, the caption,
        original_size (h, w), crop_coords (top, left), target_size (h, w)."""
        d = self.dataset
        caption = d.caption(i, epoch)
        item = self.text_trim.apply(dict(self.texts.load(caption)))   # (the tokens no attention sees cut)
        if "latents" in item:
            raise DataError("encode_prompts returned a key named 'latents', which the batch uses for the VAE latents")
        if self.preservation is not None:           # (output preservation: the preservation prompt's embeddings)
            kept = self.text_trim.apply(dict(self.texts.load(d.preservation_caption(caption, i, self.preservation))))
            item.update({PRESERVATION + k: v for k, v in kept.items()})
        item["latents"] = self.latents.load(d.latent_spec(i))
        control = d.control_spec(i) if d.has_controls else None
        if control is not None:                     # (Flux Kontext's edit pairs: control_path)
            item["control_latents"] = self.latents.load(control)
        if self.masks is not None:                  # (loss masks: mask_path / alpha_mask)
            spec = d.mask_spec(i, self.masks.factor)
            lat = item["latents"]
            item["loss_mask"] = (self.masks.load(spec) if spec is not None
                                 else np.ones((1,) + tuple(np.shape(lat)[-2:]), np.float32))
        if getattr(d, "has_reg", False):
            item["is_reg"] = d.is_reg(i)
        if getattr(d, "has_prior_reg", False):
            item["prior_reg"] = d.prior_reg(i)
        item["caption"] = caption
        item["original_size"], item["crop_coords"], item["target_size"] = (d.original_size(i), d.crop_coords(i),
                                                                           d.target_size(i))
        return item

    def collate(self, items):
        """Stack a list of samples (one bucket) into a batch."""
        batch = {"captions": [it["caption"] for it in items]}
        for k in items[0]:
            if k == "caption":
                continue
            if k in SIZE_KEYS:
                batch[k] = np.asarray([it[k] for it in items], dtype=np.int64)
                continue
            if k in ("is_reg", "prior_reg"):
                batch[k] = np.asarray([it[k] for it in items], dtype=bool)
                continue
            shapes = {tuple(np.shape(it[k])) for it in items}
            if len(shapes) > 1:
                raise DataError(f"cannot batch {k!r}: the samples' shapes differ ({sorted(shapes)}); the text "
                                f"encoder must pad every caption to one length")
            batch[k] = np.stack([it[k] for it in items])
        return batch


class BucketLoader:
    """Batches of `batch_size` samples of one bucket, shuffled per epoch from (seed, epoch); never ends. Its
    state_dict() is the sampler's (exact resume)."""

    def __init__(self, dataset, batch_size=1, shuffle=True, seed=0):
        self.dataset = dataset
        self.sampler = BucketBatchSampler(dataset.buckets(), batch_size, shuffle, seed)

    def next_batch(self):
        epoch, idx = self.sampler.next_batch()
        batch = self.dataset.collate([self.dataset.get(i, epoch) for i in idx])
        batch["indices"] = np.asarray(idx, dtype=np.int64)
        batch["epoch"] = epoch
        return batch

    def state_dict(self):
        return {**self.sampler.state_dict(), "data": self.dataset.dataset.fingerprint()}

    def load_state_dict(self, state):
        """Continue where `state` left off; DataError when it was written for other images, captions or
        dataset settings (the batches would differ)."""
        data = state.get("data")
        if data is not None and data != self.dataset.dataset.fingerprint():
            raise DataError("the data position in this checkpoint belongs to other images, captions or dataset "
                            "settings: exact resume is impossible; start fresh or restore the data")
        self.sampler.load_state_dict(state)
