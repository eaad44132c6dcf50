"""Image folders and text prompts, stage by stage, so that one model is on the device at a time (Trainer.setup
runs these after every image was checked and before the transformer is built):

latents  the VAE is loaded (only when a latent is missing from the cache or previews will be decoded), every
         (image, bucket) latent not cached yet is encoded, then the VAE leaves the device: with previews its weights
         wait in host memory (moved to the device for each decode and back; under max_gpu_memory the decode is tiled
         and its measured peak is reserved when the transformer's resident blocks are chosen), else it is dropped.
         Loss masks (mask_path / alpha_mask) are placed on the latent grid and cached here too (no model needed).
text     the text encoders are loaded (only when something is missing from the cache), every caption variant the run
         can draw (the tag orders of the epochs it covers, the dropout captions), the sample prompts, the previews'
         negative prompt (the family's negative_prompt) and the empty caption are encoded, then the encoders are
         freed. With train.train_text_encoder (text_training.py) nothing is encoded here: the encoders are loaded,
         every caption the run can draw is tokenised once (each sample then carries its token ids), and the encoders
         stay on the device to train; the preview prompts are encoded with them at each preview.

Caches: latents (and masks) in each image folder's .flame_cache/latents (masks) when its cache_latents_to_disk is
on (else host memory); text embeddings in .flame_cache/text of the first folder that caches to disk (else host
memory). Their keys hash the content and the encoder's identity: nothing unchanged is encoded twice.
"""
import gc
import os

import numpy as np

from flame_core import memory

from ..data import (
    BucketLoader,
    ImageDataset,
    LatentCache,
    TextEmbeddingCache,
    TrainingDataset,
    evaluation_config,
    split_records,
)
from ..data.buckets import Bucket, place
from ..data.captions import PreservationPrompt, apply_trigger
from ..data.config import CACHE_FOLDER, resolutions
from ..data.dataset import LatentSpec
from ..data.images import probe_image
from ..data.masks import MaskCache
from ..data.reg_mix import RegMixLoader
from ..data.text_trim import MASK_KEY
from . import prompt_options
from .samples import PreviewPrompt
from .text_training import CaptionTokens

PREVIEW_TILE = 512  # pixels: previews are decoded in tiles of this size under max_gpu_memory


def preservation_prompt(train):
    """The captions.PreservationPrompt of the run's output preservation, or None without it."""
    if train.diff_output_preservation:
        return PreservationPrompt(train.diff_output_preservation_class)
    return PreservationPrompt(None) if train.blank_prompt_preservation else None


def image_dataset(cfg, verbose=True):
    """Every image and caption checked (stage 'check', before any model)."""
    return ImageDataset(cfg.datasets, seed=cfg.train.seed, trigger_word=cfg.trigger_word, progress=verbose)


def image_datasets(cfg, verbose=True):
    """(training ImageDataset, validation ImageDataset or None), every image of both checked: with
    `validation.split` the held-out images leave the training set (flame_models/data/holdout.py); with
    `validation.folder_path` that folder is read with datasets[0]'s captions, resolutions and buckets. The
    validation set is read without augmentation (holdout.evaluation_config)."""
    full = image_dataset(cfg, verbose)
    v = cfg.validation
    if v is None:
        return full, None
    if v.split:
        train, held = split_records(full, v.split, v.seed)
        train_ds = full.select(train)
        train_ds.warnings = full.warnings
        return train_ds, full.select(held, [evaluation_config(c) for c in full.configs])
    val_cfg = evaluation_config(cfg.datasets[0], folder_path=v.folder_path, control_path=v.control_path)
    return full, ImageDataset([val_cfg], seed=cfg.train.seed, trigger_word=cfg.trigger_word, progress=verbose)


def default_sample_size(cfg):
    """The largest resolution of the first dataset, square."""
    r = resolutions(cfg.datasets[0])[-1]
    return r, r


def text_cache_folder(cfg):
    for d in cfg.datasets:
        if d.cache_latents_to_disk:
            return os.path.join(d.folder_path, CACHE_FOLDER, "text")
    return None


def sample_prompts(cfg, dataset):
    """[(prompt text, dataset index or None)]: sample.prompts ([trigger] replaced, their flags -- --w, --h, --n,
    --ctrl_img, ...: prompt_options -- taken out), else the captions of the first sample.num_samples distinct images
    of the dataset (not of its regularisation images)."""
    if cfg.sample.prompts:
        return [(apply_trigger(o.text, cfg.trigger_word, add_if_missing=False), None) for o in prompt_options_of(cfg)]
    if dataset is None:
        return []
    out, seen = [], set()
    for i in range(len(dataset)):
        rec = dataset.samples[i].record
        if rec in seen or dataset.is_reg(i):
            continue
        seen.add(rec)
        out.append((dataset.plain_caption(i), i))
        if len(out) == cfg.sample.num_samples:
            break
    return out


def prompt_options_of(cfg):
    """[PromptOptions per sample.prompts entry] (prompt_options.parse; validation reported any that do not read)."""
    return [prompt_options.parse(p) for p in cfg.sample.prompts]


def preview_sizes(cfg):
    """[(height, width) per sample prompt] -- a prompt's --h / --w, else sample.height / width -- or the one default
    size when the previews come from the dataset's captions."""
    default = (cfg.sample.height, cfg.sample.width)
    return [o.size(*default) for o in prompt_options_of(cfg)] or [default]


def preview_controls(cfg, family):
    """[LatentSpec or None per sample prompt]: for a family that edits with a control image (Flux Kontext), the
    `--ctrl_img <path>` of each of sample.prompts (ai-toolkit's flag), cover-resized and centred to the prompt's
    preview size (its --w / --h, else sample.width x sample.height), kept in host memory; [] without such prompts."""
    if not family.control_images or not cfg.sample.prompts:
        return []
    paths = [o.ctrl_img for o in prompt_options_of(cfg)]
    if not any(paths):
        return []
    specs = []
    for path, (h, w) in zip(paths, preview_sizes(cfg)):
        if not path:
            specs.append(None)
            continue
        bucket = Bucket(w, h)
        rec = probe_image(path, os.path.dirname(path) or ".")     # decoded whole: a broken file fails here, named
        p = place(rec.width, rec.height, bucket)
        specs.append(LatentSpec(rec.path, rec.sha256, bucket, p.resized, p.crop, False, False))
    return specs


class Prepared:
    """What the stages leave for training: the loader (image data), the preview prompts, the preview decoder
    and the device bytes a preview decode needs; with train.train_text_encoder the loaded text encoders, the
    prompts' texts and negative prompts (the prompts' conditioning is encoded at each preview); the held-out
    images over the caches (validation: a TrainingDataset) when the run has a validation loss."""

    def __init__(self):
        self.loader = self.latents = self.texts = self.validation = None
        self.text_encoders = None
        self.negatives = []      # each preview prompt's negative text (its --n, else the run's), or None
        self.prompt_texts = []
        self.prompts = []
        self.decode = None
        self.decode_bytes = 0
        self.encoded = {"latents": 0, "text": 0}


def prepare(cfg, family, dataset, previews_on, *, device, budget, meter, log, verbose=True,
            shard_loader=lambda loader: loader, validation=None, encode=True):
    """Run the latent and text stages of the run `cfg` of model `family` on `device` within `budget` (bytes or
    None), each timed by `meter` (stages.StageMeter); `dataset` an ImageDataset, or None for precomputed samples with
    sample.prompts / model.vae_path; previews_on: whether previews will be decoded (the VAE is kept for them). `log`
    takes the notes, `verbose` shows progress bars; `shard_loader(loader)` gives this rank's share of the batches
    (ddp); `validation`: the held-out ImageDataset, cached with the training data (Prepared.validation).
    encode=False (a finished run's rerun: no step left to train): only what the checkpoint is restored into -- the
    loader and, with train.train_text_encoder, the text encoders (their adapters) -- nothing cached, encoded,
    tokenised or kept for previews or validation. Returns Prepared."""
    c, fam, dev = cfg, family, device
    out = Prepared()
    prompts = sample_prompts(c, dataset)
    options = prompt_options_of(c) if c.sample.prompts else [None] * len(prompts)   # each prompt's flags
    controls = preview_controls(c, fam) if encode else []
    loader = None
    train_te = c.train.train_text_encoder and dataset is not None
    if dataset is not None:
        latents = LatentCache(fam.vae_id(c.model, dev))
        texts = CaptionTokens(None) if train_te else TextEmbeddingCache(text_cache_folder(c),
                                                                        fam.text_encoder_id(c.model, dev, budget))
        masks = MaskCache(fam.vae_scale_factor) if dataset.has_masks else None
        # train.diff_output_preservation / blank_prompt_preservation: every caption's preservation prompt (its
        # trigger word -> the class word; or the empty prompt)
        prompt = preservation_prompt(c.train)
        data = TrainingDataset(dataset, latents, texts, masks, preservation=prompt)
        trim = data.text_trim                    # planned once the text cache is filled (below); views share it
        shuffle = all(d.shuffle for d in c.datasets)
        loader = (RegMixLoader.build(data, c.train.batch_size, shuffle, c.train.seed, c.train.reg_ratio)
                  if dataset.has_reg else BucketLoader(data, c.train.batch_size, shuffle=shuffle, seed=c.train.seed))
        loader = shard_loader(loader)  # ddp: global batches of batch_size x ranks (more epochs per run)
        epochs = range(loader.sampler.epochs_needed(c.train.steps * c.train.gradient_accumulation_steps))
        captions = dataset.prompts(epochs) + [r.dropout_caption for r in dataset.rules]
        if prompt is not None:
            captions += dataset.preservation_prompts(epochs, prompt)
        if validation is not None:
            captions += validation.prompts([0])
    else:
        latents, masks, captions, trim = None, None, [], None
        texts = TextEmbeddingCache(None, fam.text_encoder_id(c.model, dev, budget)) if prompts else None
    if not encode:
        out.loader, out.latents, out.texts = loader, latents, texts
        if train_te:
            out.text_encoders = fam.load_text_encoders(c.model, dev, budget)
        return out

    # ---- latents
    decode_vae = previews_on and (dataset is not None or c.model.vae_path is not None)
    if controls and latents is None:
        latents = LatentCache(fam.vae_id(c.model, dev))
    if dataset is not None or decode_vae or controls:
        with meter.stage("latents"):
            vae, out.encoded["latents"] = _cache_latents(c, fam, dataset, latents, decode_vae, device=dev,
                                                         budget=budget, log=log, verbose=verbose,
                                                         validation=validation, extra=[s for s in controls if s])
            if dataset is not None and masks is not None:
                specs = dataset.mask_specs(masks.factor)
                out.encoded["masks"] = masks.fill(specs, progress=verbose)
                log(f"loss masks: {out.encoded['masks']} placed on the latent grid ({len(specs)} masked samples; the "
                    f"rest were cached)")
            if vae is not None:
                out.decode, out.decode_bytes = _decoder(fam, vae, max(preview_sizes(c), key=lambda hw: hw[0] * hw[1]),
                                                        dev, meter)   # (sized for the largest preview)
            del vae

    # ---- text
    negative = fam.negative_prompt(c) if prompts else None
    # each prompt's negative: its --n, else the run's (families whose previews take one: prompt_options)
    negatives = [o.negative if o is not None and o.negative is not None else negative for o in options]
    if train_te:
        with meter.stage("text"):
            log(f"text encoders: {fam.describe_text_encoders(c.model, dev, budget)}, kept on {dev} to train "
                f"(train.train_text_encoder); tokenising {len(set(captions))} captions")
            enc = fam.load_text_encoders(c.model, dev, budget)
            texts.tokenize = lambda ps: fam.caption_tokens(enc, ps)
            texts.fill(captions + [""])
        loader.dataset.check(epochs)
        out.validation = _validation_data(validation, latents, texts)
        out.text_encoders, out.negatives = enc, negatives
        out.prompt_texts = [text for text, _ in prompts]
        out.prompts = [PreviewPrompt(text, _control(fam, dataset, latents, i, controls, k),
                                     None if i is None else latents.load(dataset.latent_spec(i)), options[k])
                       for k, (text, i) in enumerate(prompts)]
        out.loader, out.latents, out.texts = loader, latents, texts
        return out
    wanted = list(dict.fromkeys(captions + [p for p, _ in prompts] + ([""] if captions else [])
                                + [n for n in negatives if n is not None]))
    if wanted:
        with meter.stage("text"):
            missing = texts.missing(wanted)
            if missing:
                log(f"text encoders: {fam.describe_text_encoders(c.model, dev, budget)}; encoding "
                    f"{len(missing)} of {len(wanted)} captions and prompts")
                with _limit(dev, budget):
                    enc = fam.load_text_encoders(c.model, dev, budget)
                    try:
                        out.encoded["text"] = texts.fill(wanted, lambda ps: fam.encode_prompts(enc, ps),
                                                         progress=verbose)
                    finally:
                        enc.free()
                        del enc
                        _release(dev)
            else:
                log(f"text embeddings: all {len(wanted)} cached; text encoders not loaded")
    if loader is not None:
        loader.dataset.check(epochs)
        if _plan_text_trim(fam, texts, captions, trim):
            log(trim.describe())
    out.validation = _validation_data(validation, latents, texts, trim)
    def neg(k):
        return {} if negatives[k] is None else {f"negative_{key}": v for key, v in texts.load(negatives[k]).items()}
    out.prompts = [PreviewPrompt(text,
                                 {**texts.load(text), **neg(k), **_control(fam, dataset, latents, i, controls, k)},
                                 None if i is None else latents.load(dataset.latent_spec(i)), options[k])
                   for k, (text, i) in enumerate(prompts)]
    out.loader, out.latents, out.texts = loader, latents, texts
    return out


def _plan_text_trim(fam, texts, captions, trim):
    """Plan `trim` (data/text_trim.py) from every caption's cached mask and the family's attended prefix of it
    (attended_text_length); True when the batches' text is cut. Nothing is cut for a family without one, for
    trained text encoders (token ids, not embeddings) or when a caption's mask is not a prefix."""
    if trim is None or not isinstance(texts, TextEmbeddingCache) or not captions:
        return False
    prefixes, full = [], None
    for p in dict.fromkeys(captions):
        mask = texts.load_array(p, MASK_KEY)
        if mask is None or mask.ndim != 1 or (full is not None and mask.shape[0] != full):
            return False
        full = mask.shape[0]
        k = fam.attended_text_length(mask)
        if k is None:
            return False
        prefixes.append(k)
    return trim.plan(prefixes, full) is not None


def _validation_data(validation, latents, texts, trim=None):
    """The held-out images over the filled caches (every entry checked present), or None. `trim`: the training
    data's TextTrim (the held-out captions are among those it was planned from)."""
    if validation is None:
        return None
    data = TrainingDataset(validation, latents, texts, text_trim=trim)
    data.check([0])
    return data


def _control(fam, dataset, latents, i, controls=(), k=None):
    """{"control_latents": ...} for a family that edits with a control image (Flux Kontext): sample prompt k's
    `--ctrl_img` (controls[k], preview_controls), else dataset item i's control image (its previews of a dataset
    caption take that as the reference), else {}."""
    if k is not None and k < len(controls) and controls[k] is not None:
        return {"control_latents": latents.load(controls[k])}
    if i is None or not fam.control_images or dataset is None or not dataset.has_controls:
        return {}
    spec = dataset.control_spec(i)
    return {} if spec is None else {"control_latents": latents.load(spec)}


def _cache_latents(cfg, fam, dataset, latents, keep_for_previews, *, device, budget, log, verbose, validation=None,
                   extra=()):
    """(the VAE when kept for previews else None, how many latents were encoded). `extra`: more LatentSpecs to
    encode (the sample prompts' --ctrl_img images)."""
    dev = device
    specs = dataset.latent_specs() if dataset is not None else []
    specs += validation.latent_specs() if validation is not None else []
    specs += list(extra)
    missing = latents.missing(specs) if specs else []
    if not missing and not keep_for_previews:
        log(f"latents: all {len(specs)} cached; VAE not loaded")
        return None, 0
    done = 0
    with _limit(dev, budget):
        vae = fam.load_vae(cfg.model, dev)
        if budget is not None:
            vae.enable_tiling(PREVIEW_TILE)
        if missing:
            log(f"latents: encoding {len(missing)} of {len(specs)} (image, bucket) pairs")
            batch = 1 if budget is not None else 4
            done = latents.fill(specs, lambda px: fam.encode_images(vae, px), batch_size=batch,
                                progress=verbose)
        elif specs:
            log(f"latents: all {len(specs)} cached")
    if not keep_for_previews:
        del vae
        _release(dev)
        return None, done
    return vae, done


def _decoder(fam, vae, size, dev, meter):
    """(PreviewDecoder, device bytes one preview decode at `size` (h, w) needs: its measured peak, plus the VAE's
    weights when they come from host memory)."""
    h, w = size
    f = fam.vae_scale_factor
    probe = np.zeros((1, fam.latent_channels, h // f, w // f), np.float32)
    _release(dev)
    base = memory.memory_allocated(dev)
    meter.reset_peaks()
    fam.decode(vae, probe)
    peak = memory.max_memory_allocated(dev) - base
    weights = sum(p.numel() * p.dtype.itemsize for p in vae.parameters())
    decoder = PreviewDecoder(fam, vae, dev)
    return decoder, int(peak + (weights if decoder.on_gpu else 0))


class PreviewDecoder:
    """decode(latents (N, C, h, w)) -> images (N, 3, H, W) in [-1, 1]. On a GPU the VAE's weights wait in host
    memory and are moved to the device for each decode."""

    def __init__(self, family, vae, device):
        self.family, self.vae, self.device = family, vae, device
        self.on_gpu = device.type == "cuda"
        if self.on_gpu:
            vae.to("cpu")
            _release(device)

    def __call__(self, latents):
        if self.on_gpu:
            self.vae.to(self.device)
        try:
            return self.family.decode(self.vae, latents)
        finally:
            if self.on_gpu:
                self.vae.to("cpu")
                _release(self.device)


class _limit:
    """The run's max_gpu_memory as a limit on the pool while a stage runs, less what the driver already holds
    outside the pool (the CUDA context, libraries' workspaces): the GPU as a whole stays within the budget, and an
    encoder that would not fit fails with OutOfMemoryError instead of growing past it."""

    def __init__(self, device, budget):
        self.device, self.budget = device, budget

    def __enter__(self):
        if self.budget is not None and self.device.type == "cuda":
            import flame_core as flame
            self.prev = memory.get_memory_limit(self.device)
            free, total = flame.cuda.mem_get_info(self.device)
            outside = max(0, total - free - memory.memory_reserved(self.device))
            memory.set_memory_limit(self.budget - outside, self.device)
        return self

    def __exit__(self, *exc):
        if self.budget is not None and self.device.type == "cuda":
            memory.set_memory_limit(self.prev, self.device)
        return False


def _release(device):
    gc.collect()
    if device.type == "cuda":
        memory.empty_cache(device)
