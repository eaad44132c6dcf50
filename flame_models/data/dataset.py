"""Image datasets (ai-toolkit's `datasets:` list) as training samples: one sample per (image, repeat, flip,
resolution), each placed in an aspect-ratio bucket, with a caption that may change per epoch.

    ds = ImageDataset([DatasetConfig(folder_path="data/images", resolution=[512, 1024])], seed=42,
                      trigger_word="ohwx")
    ds.buckets()           # {Bucket(1024, 768): [sample indices], ...}
    ds.caption(i, epoch)   # the caption sample i trains with in that epoch (dropout, line and wildcard draws,
                           # tag shuffling)
    ds.latent_spec(i)      # what the latent cache needs: the image, its placement, where to store
    ds.prompts(range(E))   # every caption string epochs 0..E-1 can draw (for the text-embedding cache)

Everything that can be wrong with the inputs is found here, before any model is loaded: a missing folder, a
folder without images, an image that does not decode (the whole file is decoded), an image too small for every
bucket it maps to, a caption file that is not UTF-8, an image without a caption and without `default_caption`.
Each error names the files (all of them, up to a limit), not only the first.

Images smaller than their bucket at some resolutions but not others are kept at the resolutions they cover
(a warning says how many were left out where); `allow_upscale: true` upscales instead.

Control images (`control_path`, ai-toolkit's name: Flux Kontext's edit pairs): each image of folder_path has one in
control_path with the same relative name (any image extension); it is placed in its target's bucket with the same
resize, crop and flip when it has the target's size (as diffusers' paired transform), else cover-resized to the
bucket and centred, and cached beside its target (`control_spec`). A missing or unreadable control image is an
error naming it.

Loss masks (`mask_path` / `alpha_mask`, ai-toolkit's names: masks.py) follow their image's placement and flips
(`mask_spec`); an image without a mask file trains with weight 1 (a warning names it). Regularisation images
(`is_reg: true`) are samples like the others, flagged (`is_reg(i)`); the loader draws them in their own batches.
"""
import copy
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from . import images as I
from .buckets import Bucket, closest_bucket, make_buckets, place
from .captions import CaptionRule, caption_path, filename_caption, read_caption, stable_seed
from .config import CACHE_FOLDER, LATER_FIELDS, caption_extension, resolutions, validate_dataset_config
from .errors import DataError
from .masks import MaskSpec, find_mask
from .walk import link_problem

PREPROCESS_VERSION = 1        # bump when the pixels a placement produces change (resize filter, background, ...)
RESIZE_FILTER = "lanczos"
MAX_LISTED = 20


@dataclass(frozen=True)
class Sample:
    record: int            # index into ImageDataset.records
    config: int            # index into ImageDataset.configs
    repeat: int
    resolution: int
    flip_x: bool
    flip_y: bool
    placement: object      # buckets.Placement
    key: str               # stable name: the seed of its crop and caption dropout

    @property
    def caption_key(self):
        """The seed of its tag order: the same image (and repeat, flip) shares it across resolutions, so the
        text cache holds one set of orders per image, not one per resolution."""
        return self.key.rsplit("|", 2)[0] + "|" + self.key.rsplit("|", 1)[1]

    @property
    def bucket(self):
        return self.placement.bucket


@dataclass(frozen=True)
class LatentSpec:
    """One VAE encoding to cache: an image file, how it is turned into bucket-sized pixels, and where to keep it
    (`folder` None: host memory)."""
    path: str
    sha256: str
    bucket: Bucket
    resized: tuple         # (width, height) after the cover resize
    crop: tuple            # (top, left) of the crop in the resized image
    flip_x: bool
    flip_y: bool
    folder: str = None
    max_pixels: int = I.MAX_PIXELS   # the dataset's limit (the file is read again here: it is checked again)

    def params(self):
        """Everything besides the file's bytes that decides the pixels (part of the cache key)."""
        return {"v": PREPROCESS_VERSION, "bucket": list(self.bucket), "resized": list(self.resized),
                "crop": list(self.crop), "flip_x": self.flip_x, "flip_y": self.flip_y, "filter": RESIZE_FILTER,
                "background": list(I.BACKGROUND)}

    def pixels(self):
        """(3, bucket height, bucket width) float32 in [-1, 1]."""
        from PIL import Image
        im = I.load_image(self.path, self.max_pixels)
        im = im.resize(self.resized, Image.Resampling.LANCZOS)
        top, left = self.crop
        im = im.crop((left, top, left + self.bucket.width, top + self.bucket.height))
        if self.flip_x:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.flip_y:
            im = im.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        return I.image_array(im)


def _listing(problems):
    shown = problems[:MAX_LISTED]
    more = len(problems) - len(shown)
    return "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")


class ImageDataset:
    """Samples of one or more image folders. `configs`: DatasetConfig list; `seed`: the run's seed (crops, caption
    dropout, tag order); `trigger_word`: the run's trigger word (a config's own one wins); `cache_dir`: where disk
    latent caches go instead of each folder's `.flame_cache/latents`."""

    def __init__(self, configs, seed=0, trigger_word=None, cache_dir=None, progress=True):
        self.configs, self.seed, self.warnings = list(configs), int(seed), []
        self.trigger_word = trigger_word
        self._fingerprint = None
        if not self.configs:
            raise DataError("datasets: no dataset given")
        problems = []
        for i, c in enumerate(self.configs):
            problems += validate_dataset_config(c, f"datasets[{i}]")
        if all(c.is_reg is True for c in self.configs):
            problems.append("datasets: every dataset is is_reg: true; regularisation images go beside the images "
                            "being trained (give at least one dataset without is_reg)")
        if problems:
            raise DataError(f"{len(problems)} problem(s) in the datasets:" + _listing(problems))
        self.rules = [CaptionRule(c, seed, trigger_word) for c in self.configs]
        roots = [None if not c.cache_latents_to_disk else (cache_dir or os.path.join(c.folder_path, CACHE_FOLDER))
                 for c in self.configs]
        self.latent_folders = [r and os.path.join(r, "latents") for r in roots]
        self.mask_folders = [r and os.path.join(r, "masks") for r in roots]
        self.records, self.raw_captions, self.record_config = [], [], []
        self.controls = []        # per record: the control image's ImageRecord, or None
        self.masks = []           # per record: the mask file's ImageRecord (mask_path), or None
        problems = self._scan(progress, roots)
        self.samples = []
        problems += self._place()
        if problems:  # every unusable file at once, so one run of fixes is enough
            raise DataError(f"{len(problems)} unusable file(s) in the datasets:" + _listing(problems))
        for i, c in enumerate(self.configs):
            if c.keep_tokens and not c.shuffle_tokens:
                self.warnings.append(f"datasets[{i}].keep_tokens: has no effect without shuffle_tokens: true")

    # ------------------------------------------------------------------ scanning
    def _scan(self, progress, roots):
        """Probe every captioned image; returns the problems found."""
        jobs, missing = [], []
        for ci, c in enumerate(self.configs):
            ext = caption_extension(c)
            for path in I.list_images(c.folder_path, self.warnings.append):
                if c.caption_from != "file":   # the image's name or default_caption: no caption file read
                    jobs.append((ci, path, None))
                    continue
                cap = caption_path(path, ext)
                refused = link_problem(cap, c.folder_path)    # a caption is read under the images' link policy
                if refused is None and os.path.isfile(cap):
                    jobs.append((ci, path, cap))
                elif c.default_caption is not None:
                    jobs.append((ci, path, None))
                    if refused:
                        self.warnings.append(f"{cap}: {refused}: not read (default_caption used)")
                elif refused:
                    missing.append(f"{cap}: {refused}: not read (captions are read from inside the data folder "
                                   f"only: copy the file in, or set default_caption)")
                else:
                    missing.append(f"{path}: no caption file {os.path.basename(cap)} (add it, or set "
                                   f"default_caption for the folder)")
        # images whose folder may hold a cache (cache_latents_to_disk) keep their probes there between runs
        indexes = {r: I.ProbeIndex(os.path.join(r, "images.json")) for r in set(roots) if r is not None}
        bad, unmasked = [], {}
        for ci, path, cap in _progress(jobs, progress, "Checking images"):
            index = indexes.get(roots[ci])
            folder = self.configs[ci].folder_path
            try:
                rec = index.lookup(path, folder) if index is not None else None
                if rec is None:
                    t0 = time.time_ns()
                    rec = I.probe_image(path, folder, self.configs[ci].max_pixels)
                    if index is not None:
                        index.add(rec, t0)
                else:   # probed by an earlier run, perhaps under a larger limit
                    I.check_pixels(path, rec.width, rec.height, self.configs[ci].max_pixels)
                text = read_caption(cap) if cap else None
            except DataError as ex:
                bad.append(str(ex))
                continue
            if self.configs[ci].caption_from == "filename":
                text = filename_caption(path)
            elif text is None or (text == "" and self.configs[ci].default_caption is not None):
                text = self.configs[ci].default_caption.strip()
            control = None
            if self.configs[ci].control_path is not None:
                try:
                    control = _control_record(rec, self.configs[ci].control_path, self.configs[ci].max_pixels)
                except DataError as ex:
                    bad.append(str(ex))
                    continue
            mask = None
            if self.configs[ci].mask_path is not None:
                try:
                    mask = find_mask(rec, self.configs[ci].mask_path, self.configs[ci].max_pixels)
                except DataError as ex:
                    bad.append(str(ex))
                    continue
                if mask is None:
                    unmasked.setdefault(ci, []).append(rec.relpath)
            self.masks.append(mask)
            self.controls.append(control)
            self.records.append(rec)
            self.raw_captions.append(text)
            self.record_config.append(ci)
        for ci, names in sorted(unmasked.items()):  # ai-toolkit's rule: no mask file, no mask
            shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
            self.warnings.append(f"datasets[{ci}].mask_path: {len(names)} image(s) have no mask in "
                                 f"{self.configs[ci].mask_path} and train with weight 1 everywhere: {shown}")
        for index in indexes.values():
            try:
                index.save()
            except OSError as ex:
                self.warnings.append(f"cannot save the image index {index.path} ({ex.strerror or ex}); images "
                                     f"are checked again next time")
        return missing + bad

    # ------------------------------------------------------------------ buckets
    def _place(self):
        """Samples of every image at each resolution whose bucket it covers; returns the problems found."""
        sets = {}   # the bucket settings -> their buckets (made once)

        def bucket_set(c, r):
            key = (r, c.bucket_tolerance, c.min_bucket_reso, c.max_bucket_reso, c.max_aspect, c.resolution_mode)
            if key not in sets:
                sets[key] = make_buckets(r, c.bucket_tolerance, max_aspect=c.max_aspect, min_side=c.min_bucket_reso,
                                         max_side=c.max_bucket_reso, mode=c.resolution_mode)
            return sets[key]
        too_small, partial = [], {}
        for ri, rec in enumerate(self.records):
            ci = self.record_config[ri]
            c = self.configs[ci]
            fitting = []
            for r in resolutions(c):
                b = closest_bucket(rec.width, rec.height, bucket_set(c, r))
                fits = c.allow_upscale or place(rec.width, rec.height, b).scale <= 1.0 + 1e-9
                if fits:
                    fitting.append((r, b))
                else:
                    partial.setdefault(r, []).append((rec, b))
            if not fitting:
                r = resolutions(c)[0]
                b = closest_bucket(rec.width, rec.height, bucket_set(c, r))
                too_small.append(f"{rec.path}: {rec.width}x{rec.height} is smaller than its {b} bucket at "
                                 f"resolution {r} (images are never upscaled unless allow_upscale: true, or "
                                 f"--allow-upscale; or use a smaller resolution)")
                continue
            flips = [(False, False)] + [(True, False)] * c.flip_x + [(False, True)] * c.flip_y
            for rep in range(c.num_repeats):
                for fx, fy in flips:
                    for r, b in fitting:
                        key = f"{ci}|{rec.relpath}|{rep}|{r}|{int(fx)}{int(fy)}"
                        rng = (np.random.default_rng([stable_seed("crop", key), self.seed])
                               if c.random_crop else None)
                        self.samples.append(Sample(ri, ci, rep, r, fx, fy, place(rec.width, rec.height, b, rng), key))
        for r, lst in sorted(partial.items()):
            names = ", ".join(os.path.basename(rec.path) for rec, _ in lst[:5]) + (" ..." if len(lst) > 5 else "")
            self.warnings.append(f"{len(lst)} image(s) smaller than their bucket at resolution {r} are not trained "
                                 f"at {r} (allow_upscale: true or --allow-upscale upscales them): {names}")
        return too_small

    def select(self, records, configs=None):
        """A dataset of `records` (indices into self.records) only, placed again -- under `configs` (one per
        config of this dataset, same folders) when given: a held-out part of the images (holdout.py) without
        decoding any image again."""
        out = copy.copy(self)
        if configs is not None:
            out.configs = list(configs)
            out.rules = [CaptionRule(c, self.seed, self.trigger_word) for c in out.configs]
        records = sorted(records)
        out.records = [self.records[i] for i in records]
        out.raw_captions = [self.raw_captions[i] for i in records]
        out.record_config = [self.record_config[i] for i in records]
        out.controls = [self.controls[i] for i in records]
        out.masks = [self.masks[i] for i in records]
        out.warnings, out.samples, out._fingerprint = [], [], None
        problems = out._place()
        if problems:
            raise DataError(f"{len(problems)} unusable file(s) in the datasets:" + _listing(problems))
        return out

    # ------------------------------------------------------------------ access
    def __len__(self):
        return len(self.samples)

    def buckets(self):
        """{Bucket: [sample indices]} in order of bucket."""
        out = {}
        for i, s in enumerate(self.samples):
            out.setdefault(s.bucket, []).append(i)
        return dict(sorted(out.items()))

    def record(self, i):
        return self.records[self.samples[i].record]

    def base_caption(self, i):
        s = self.samples[i]
        return self.rules[s.config].base(self.raw_captions[s.record])

    def plain_caption(self, i):
        """Sample i's caption as trained on without the per-epoch changes (no dropout, shuffling or tag dropout;
        epoch 0's line and wildcard draws; kohya's secondary_separator replaced): a preview prompt."""
        s = self.samples[i]
        return self.rules[s.config].plain(self.base_caption(i), s.caption_key)

    def caption(self, i, epoch):
        """The caption sample i trains with in `epoch`."""
        s = self.samples[i]
        return self.rules[s.config].caption(self.base_caption(i), s.key, epoch, s.caption_key)

    def prompts(self, epochs):
        """Every caption string the samples can draw in `epochs` (an iterable of epoch numbers), each once."""
        epochs = list(epochs)
        out = {}
        for i, s in enumerate(self.samples):
            for c in self.rules[s.config].variants_over(self.base_caption(i), s.caption_key, epochs):
                out[c] = None
        return list(out)

    def preservation_caption(self, caption, i, prompt):
        """The output-preservation prompt (captions.PreservationPrompt `prompt`) of `caption`, one of sample i's."""
        return prompt(caption, self.rules[self.samples[i].config].trigger)

    def preservation_prompts(self, epochs, prompt):
        """The preservation prompt of every caption the samples can draw in `epochs` (prompts(epochs)), and of each
        dataset's dropout caption, each once."""
        epochs = list(epochs)
        out = {}
        for i, s in enumerate(self.samples):
            rule = self.rules[s.config]
            for c in [*rule.variants_over(self.base_caption(i), s.caption_key, epochs), rule.dropout_caption]:
                out[self.preservation_caption(c, i, prompt)] = None
        return list(out)

    def original_size(self, i):
        """(height, width) of the image as read (after EXIF orientation), as SDXL's conditioning takes it."""
        rec = self.record(i)
        return rec.height, rec.width

    def crop_coords(self, i):
        """(top, left) of the crop in the resized image (in the mirrored image's frame for a flipped sample)."""
        p = self.samples[i].placement
        top, left = p.crop
        if self.samples[i].flip_x:
            left = p.resized[0] - left - p.bucket.width
        if self.samples[i].flip_y:
            top = p.resized[1] - top - p.bucket.height
        return top, left

    def target_size(self, i):
        """(height, width) of the bucket."""
        b = self.samples[i].bucket
        return b.height, b.width

    def latent_spec(self, i):
        s = self.samples[i]
        rec = self.records[s.record]
        p = s.placement
        return LatentSpec(rec.path, rec.sha256, p.bucket, p.resized, p.crop, s.flip_x, s.flip_y,
                          self.latent_folders[s.config], self.configs[s.config].max_pixels)

    @property
    def has_controls(self):
        """Whether the samples have control images (control_path)."""
        return any(c is not None for c in self.controls)

    def control_spec(self, i):
        """The LatentSpec of sample i's control image (None without one): its target's placement when the sizes
        agree, else a cover resize to the bucket, centred; the target's flips."""
        s = self.samples[i]
        ctl = self.controls[s.record]
        if ctl is None:
            return None
        rec, p = self.records[s.record], s.placement
        if (ctl.width, ctl.height) != (rec.width, rec.height):
            p = place(ctl.width, ctl.height, p.bucket)
        return LatentSpec(ctl.path, ctl.sha256, p.bucket, p.resized, p.crop, s.flip_x, s.flip_y,
                          self.latent_folders[s.config], self.configs[s.config].max_pixels)

    @property
    def has_masks(self):
        """Whether any dataset weights its loss by masks (mask_path or alpha_mask)."""
        return any(c.mask_path is not None or c.alpha_mask for c in self.configs)

    def mask_spec(self, i, factor=8):
        """The MaskSpec of sample i at `factor` pixels per latent pixel (its image's placement and flips), or None
        when it has no mask (weight 1)."""
        s = self.samples[i]
        c, rec = self.configs[s.config], self.records[s.record]
        src = rec if c.alpha_mask else self.masks[s.record]
        if src is None:
            return None
        p = s.placement
        return MaskSpec(src.path, src.sha256, bool(c.alpha_mask), bool(c.invert_mask), float(c.mask_min_value),
                        p.bucket, p.resized, p.crop, s.flip_x, s.flip_y, int(factor), self.mask_folders[s.config],
                        c.max_pixels)

    def mask_specs(self, factor=8):
        """Every sample's MaskSpec (those with a mask)."""
        return [m for m in (self.mask_spec(i, factor) for i in range(len(self))) if m is not None]

    def is_reg(self, i):
        """Whether sample i is a regularisation image (its dataset's is_reg)."""
        return bool(self.configs[self.samples[i].config].is_reg)

    @property
    def has_reg(self):
        return any(c.is_reg for c in self.configs)

    def prior_reg(self, i):
        """Whether sample i trains toward the adapter-free model's prediction (its dataset's prior_reg)."""
        return bool(self.configs[self.samples[i].config].prior_reg)

    @property
    def has_prior_reg(self):
        return any(c.prior_reg for c in self.configs)

    def latent_specs(self):
        """Every encoding to cache: each sample's image, then its control image (when it has one)."""
        targets = [self.latent_spec(i) for i in range(len(self))]
        controls = [self.control_spec(i) for i in range(len(self))] if self.has_controls else []
        return targets + [c for c in controls if c is not None]

    def fingerprint(self):
        """A hash of the settings, samples, buckets, crops and captions: equal across runs on the same data and
        settings, different when anything that changes the batches changes."""
        if self._fingerprint is None:
            # (max_pixels refuses files but changes no batch: runs saved before it existed still resume)
            # (nor do the fields added later, at their defaults: the runs saved before them resume too)
            configs = [{k: v for k, v in asdict(c).items()
                        if k != "max_pixels" and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
                       for c in self.configs]
            h = hashlib.sha256(json.dumps([self.seed, configs,
                                           [r.trigger for r in self.rules]], sort_keys=True).encode("utf-8"))
            for s in self.samples:
                rec = self.records[s.record]
                ctl, mask = self.controls[s.record], self.masks[s.record]
                h.update(json.dumps([s.key, rec.sha256, list(s.bucket), list(s.placement.crop),
                                     self.raw_captions[s.record]] + ([ctl.sha256] if ctl else [])
                                    + (["mask", mask.sha256] if mask else [])).encode("utf-8"))
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def summary(self):
        """Lines describing the images, samples and buckets (for the trainer's log)."""
        lines = [f"{len(self.records)} images, {len(self.samples)} samples per epoch in "
                 f"{len(self.buckets())} buckets"]
        n_reg = sum(self.is_reg(i) for i in range(len(self)))
        if n_reg:
            lines[0] += f" ({n_reg} of the samples regularisation images, is_reg)"
        for b, idx in self.buckets().items():
            lines.append(f"  {b}: {len(idx)}")
        return lines


def _control_record(rec, control_path, max_pixels):
    """The ImageRecord of the control image of `rec` in `control_path` (the same relative name, any image
    extension); DataError naming what is missing."""
    stem = os.path.splitext(rec.relpath)[0]
    found = [os.path.join(control_path, stem + ext) for ext in I.IMAGE_EXTENSIONS + tuple(
        e.upper() for e in I.IMAGE_EXTENSIONS)]
    found = [f for f in found if os.path.isfile(f)]
    if not found:
        raise DataError(f"{rec.path}: no control image {stem}.* in control_path {control_path}")
    if len(found) > 1 and len({os.path.normcase(os.path.realpath(f)) for f in found}) > 1:
        raise DataError(f"{rec.path}: several control images in {control_path}: "
                        f"{', '.join(os.path.basename(f) for f in found)}; keep one")
    return I.probe_image(found[0], control_path, max_pixels)


def _progress(items, enabled, desc):
    if not enabled or len(items) < 2:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="img", leave=False)
