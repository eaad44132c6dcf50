"""One entry of ai-toolkit's `datasets:` list, and its validation (every problem at once, each with its field path).

Field names are ai-toolkit's (toolkit/config_modules.py DatasetConfig) where it has the concept, else kohya's
(`caption_separator`), else FLAME's own (`allow_upscale`, `shuffle_variants`), named in the comments.
"""
import os
import typing
from dataclasses import dataclass

from .buckets import MODES
from .walk import walk_files

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
CACHE_FOLDER = ".flame_cache"        # inside a dataset folder; hidden, so the image scan never enters it
BUCKET_MULTIPLE = 32                 # bucket sides must be multiples of this: SDXL's UNet needs latents divisible by 4
MAX_PIXELS = 8192 * 8192             # 64 megapixels: larger images are refused from their header, before decoding


@dataclass
class DatasetConfig:
    folder_path: str = None              # images (png, jpg/jpeg, webp), searched recursively; hidden entries skipped
    caption_ext: str = "txt"             # caption of `a.png` is `a.txt` (a leading dot is accepted: ".txt")
    default_caption: str = None          # for images without a caption file (else: an error naming them)
    caption_from: str = "file"           # FLAME: "file" (the caption file, else default_caption), "filename" (the
                                         # image's name, "_" read as spaces: SimpleTuner's caption_strategy
                                         # filename) or "default_caption" (every image's, caption files unread:
                                         # SimpleTuner's instanceprompt)
    trigger_word: str = None             # this folder's trigger word (else the run's `trigger_word`)
    caption_dropout_rate: float = 0.0    # per sample and epoch, the caption becomes the dropout caption
    caption_tag_dropout_rate: float = 0.0  # kohya's: per sample and epoch each tag (but the kept ones) is dropped
    caption_dropout_every_n_epochs: int = 0  # kohya's: every caption is the dropout caption in epochs N, 2N, ...
                                         # (counted from 1, as kohya counts them); 0: never
    shuffle_tokens: bool = False         # shuffle the caption's tags every epoch (kohya: shuffle_caption)
    keep_tokens: int = 0                 # the first N tags stay in place when shuffling
    caption_separator: str = ","         # kohya's name; tags are split on it and joined with it plus a space
    keep_tokens_separator: str = None    # kohya's (e.g. "|||"): the tags before it stay first and those after a
                                         # second one stay last; only the middle ones shuffle (keep_tokens unused)
    secondary_separator: str = None      # kohya's (e.g. ";;;"): tags joined by it shuffle and drop as one tag, and
                                         # it becomes caption_separator in the caption trained on
    caption_prefix: str = None           # kohya's: put before every caption, with a space (before the trigger word
    caption_suffix: str = None           # is placed and the tags shuffled); the suffix after it, likewise
    enable_wildcard: bool = False        # kohya's: "{a|b|c}" becomes one of a, b, c per sample and epoch ("{{" and
                                         # "}}" are literal braces)
    caption_lines: str = "all"           # FLAME: a multi-line caption file trains as "all" its text (ai-toolkit),
                                         # its "first" line (kohya without enable_wildcard) or a "random" line per
                                         # sample and epoch (kohya with it); blank lines are never drawn
    shuffle_variants: int = None         # FLAME: None = a new tag order each epoch; K = orders cycle through K
    num_repeats: int = 1                 # every image appears this many times per epoch
    resolution: typing.Any = 512         # int or list (e.g. [512, 768, 1024]): one bucket set per resolution
    bucket_tolerance: int = 64           # ai-toolkit's name: bucket sides are multiples of this many pixels
    max_aspect: float = 4.0              # FLAME: the buckets' widest aspect ratio, both ways; 1: square buckets
                                         # only (kohya's enable_bucket = false, SimpleTuner's crop_aspect square)
    resolution_mode: str = "area"        # FLAME: "area" buckets hold about resolution² pixels; "short_side" keep
                                         # the shorter side at resolution (SimpleTuner's resolution_type pixel:
                                         # a 2:1 image trains at 2·resolution² pixels; data/buckets.py)
    min_bucket_reso: int = None          # kohya's: no bucket side below this many pixels (None: no bound)
    max_bucket_reso: int = None          # kohya's: no bucket side above this many pixels
    random_crop: bool = False            # crop position drawn once per (image, repeat, resolution); else centred
    flip_x: bool = False                 # add a mirrored copy of every image (as ai-toolkit does)
    flip_y: bool = False                 # add an upside-down copy of every image
    allow_upscale: bool = False          # FLAME (kohya's bucket_no_upscale, inverted): upscale small images
    cache_latents_to_disk: bool = False  # latents in <folder_path>/.flame_cache/latents (else in host memory)
    shuffle: bool = True                 # shuffle batches every epoch
    max_pixels: int = MAX_PIXELS         # FLAME: width x height above this is refused before decoding (bomb guard)
    control_path: str = None             # ai-toolkit: a folder of control (source) images, one per image of
                                         # folder_path with the same name (Flux Kontext's edit pairs)
    # loss masks (ai-toolkit's names; masks.py): the loss of each latent pixel is weighted by the mask there
    mask_path: str = None                # a folder of grayscale masks, one per image with the same name (white:
                                         # full weight, black: mask_min_value); an image without one: weight 1
    alpha_mask: bool = False             # the image's own alpha channel is its mask (kohya's alpha_mask too)
    invert_mask: bool = False            # weight by 1 - mask
    mask_min_value: float = 0.0          # mask values [0, 1] map to weights [mask_min_value, 1]
    is_reg: bool = False                 # ai-toolkit: regularisation (prior-preservation) images, drawn in their
                                         # own batches at train.reg_ratio, their loss scaled by train.reg_weight
    prior_reg: bool = False              # ai-toolkit: these images train toward the model's own prediction without
                                         # the adapters (same noisy input and caption), not toward the data
                                         # (SimpleTuner's is_regularisation_data); with is_reg or without

# the fields added after runs were first saved: at their defaults they leave a run's fingerprint as it was
LATER_FIELDS = {"control_path": None, "mask_path": None, "alpha_mask": False, "invert_mask": False,
                "mask_min_value": 0.0, "is_reg": False, "min_bucket_reso": None, "max_bucket_reso": None,
                "caption_prefix": None, "caption_suffix": None, "keep_tokens_separator": None,
                "caption_tag_dropout_rate": 0.0, "secondary_separator": None, "caption_dropout_every_n_epochs": 0,
                "enable_wildcard": False, "caption_lines": "all", "caption_from": "file", "max_aspect": 4.0,
                "prior_reg": False, "resolution_mode": "area"}
CAPTION_LINES = ("all", "first", "random")
CAPTION_FROM = ("file", "filename", "default_caption")
MAX_ASPECT_BOUND = 8.0   # (a wider bucket is a strip of a few pixels)


def resolutions(cfg):
    """The resolutions of a config as a sorted list of ints."""
    r = cfg.resolution
    return sorted({int(x) for x in (r if isinstance(r, (list, tuple)) else [r])})


def caption_extension(cfg):
    """'.txt' for caption_ext 'txt' or '.txt'."""
    ext = str(cfg.caption_ext)
    return ext if ext.startswith(".") else "." + ext


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def validate_dataset_config(cfg, path_prefix="datasets[0]", check_files=True):
    """Every problem of one DatasetConfig as messages `<path_prefix>.<field>: ...` (empty: valid).

    With `check_files`, also that the folder exists and holds at least one image (cheap: a directory walk)."""
    e, p = [], path_prefix
    for name in ("shuffle_tokens", "random_crop", "flip_x", "flip_y", "allow_upscale", "cache_latents_to_disk",
                 "shuffle", "alpha_mask", "invert_mask", "is_reg", "enable_wildcard", "prior_reg"):
        if not isinstance(getattr(cfg, name), bool):
            e.append(f"{p}.{name}: expected true or false, got {getattr(cfg, name)!r}")
    for name in ("caption_ext", "caption_separator"):
        v = getattr(cfg, name)
        if not isinstance(v, str) or not v.strip(". " if name == "caption_ext" else " "):
            e.append(f"{p}.{name}: expected a non-empty string, got {v!r}")
    if isinstance(cfg.caption_ext, str) and any(c in cfg.caption_ext for c in "/\\"):
        e.append(f"{p}.caption_ext: an extension such as 'txt', got {cfg.caption_ext!r}")
    ks = cfg.keep_tokens_separator
    if ks is not None and (not isinstance(ks, str) or not ks.strip()
                           or ks.strip() == str(cfg.caption_separator).strip()):
        e.append(f"{p}.keep_tokens_separator: a non-empty string other than caption_separator (kohya writes '|||'), "
                 f"got {ks!r}")
    ss = cfg.secondary_separator
    if ss is not None and (not isinstance(ss, str) or not ss.strip()
                           or ss.strip() in (str(cfg.caption_separator).strip(), str(ks or "").strip())
                           or str(cfg.caption_separator).strip() in ss):
        e.append(f"{p}.secondary_separator: a non-empty string other than caption_separator and "
                 f"keep_tokens_separator, not containing caption_separator (kohya writes ';;;'), got {ss!r}")
    for name in ("default_caption", "trigger_word", "caption_prefix", "caption_suffix"):
        v = getattr(cfg, name)
        if v is not None and not isinstance(v, str):
            e.append(f"{p}.{name}: expected a string, got {type(v).__name__} {v!r}")
    for name in ("caption_dropout_rate", "caption_tag_dropout_rate"):
        v = getattr(cfg, name)
        if not _is_number(v) or not 0 <= v <= 1:
            e.append(f"{p}.{name}: a probability in [0, 1], got {v!r}")
    n = cfg.caption_dropout_every_n_epochs
    if not _is_int(n) or n < 0:
        e.append(f"{p}.caption_dropout_every_n_epochs: an integer >= 0 (0: never), got {n!r}")
    if cfg.caption_from not in CAPTION_FROM:
        e.append(f"{p}.caption_from: one of {', '.join(CAPTION_FROM)}, got {cfg.caption_from!r}")
    elif cfg.caption_from == "default_caption" and not (isinstance(cfg.default_caption, str)
                                                        and cfg.default_caption.strip()):
        e.append(f"{p}.caption_from: default_caption gives every image default_caption, which is not set")
    if not _is_number(cfg.max_aspect) or not 1 <= cfg.max_aspect <= MAX_ASPECT_BOUND:
        e.append(f"{p}.max_aspect: a number in [1, {MAX_ASPECT_BOUND:g}] (1: square buckets only), got "
                 f"{cfg.max_aspect!r}")
    if cfg.resolution_mode not in MODES:
        e.append(f"{p}.resolution_mode: one of {', '.join(MODES)}, got {cfg.resolution_mode!r}")
    if cfg.caption_lines not in CAPTION_LINES:
        e.append(f"{p}.caption_lines: one of {', '.join(CAPTION_LINES)}, got {cfg.caption_lines!r}")
    if not _is_int(cfg.keep_tokens) or cfg.keep_tokens < 0:
        e.append(f"{p}.keep_tokens: an integer >= 0, got {cfg.keep_tokens!r}")
    if cfg.shuffle_variants is not None and (not _is_int(cfg.shuffle_variants) or cfg.shuffle_variants < 1):
        e.append(f"{p}.shuffle_variants: null (a new order every epoch) or an integer >= 1, got "
                 f"{cfg.shuffle_variants!r}")
    if not _is_int(cfg.num_repeats) or cfg.num_repeats < 1:
        e.append(f"{p}.num_repeats: an integer >= 1, got {cfg.num_repeats!r}")
    if not _is_int(cfg.max_pixels) or cfg.max_pixels < 1:
        e.append(f"{p}.max_pixels: a positive integer (width x height), got {cfg.max_pixels!r}")

    step = cfg.bucket_tolerance
    if not _is_int(step) or step < BUCKET_MULTIPLE or step % BUCKET_MULTIPLE:
        e.append(f"{p}.bucket_tolerance: a positive multiple of {BUCKET_MULTIPLE} (pixels), got {step!r}")
        step = None
    res = cfg.resolution
    items = res if isinstance(res, list) else [res]
    if isinstance(res, list) and not res:
        e.append(f"{p}.resolution: an integer or a non-empty list of integers, got []")
    for i, r in enumerate(items):
        where = f"{p}.resolution" + (f"[{i}]" if isinstance(res, list) else "")
        if not _is_int(r) or r <= 0:
            e.append(f"{where}: a positive integer (pixels), got {r!r}")
        elif step is not None and r % step:
            e.append(f"{where}: {r} is not a multiple of bucket_tolerance {step}; "
                     f"try {max(step, r // step * step)} or {(r // step + 1) * step}")
    if isinstance(res, list) and all(_is_int(r) for r in res) and len(set(res)) != len(res):
        e.append(f"{p}.resolution: {res} lists a resolution twice")
    bounds = {}
    for name in ("min_bucket_reso", "max_bucket_reso"):
        v = getattr(cfg, name)
        if v is not None and (not _is_int(v) or v <= 0):
            e.append(f"{p}.{name}: null or a positive number of pixels, got {v!r}")
        elif v is not None:
            bounds[name] = v
    lo, hi = bounds.get("min_bucket_reso"), bounds.get("max_bucket_reso")
    if lo is not None and hi is not None and lo > hi:
        e.append(f"{p}.min_bucket_reso: {lo} is above max_bucket_reso {hi}")
    for r in items:
        if _is_int(r) and ((lo is not None and r < lo) or (hi is not None and r > hi)):
            e.append(f"{p}.resolution: {r} lies outside [min_bucket_reso, max_bucket_reso] = [{lo}, {hi}] (its "
                     f"square bucket's sides must fit them)")

    cp = cfg.control_path
    if cp is not None and (not isinstance(cp, str) or not cp):
        e.append(f"{p}.control_path: a folder of control images, got {cp!r}")
    elif cp is not None and check_files and not os.path.isdir(cp):
        e.append(f"{p}.control_path: no such folder: {cp}")

    e += _mask_problems(cfg, p, check_files)

    fp = cfg.folder_path
    if not fp or not isinstance(fp, str):
        e.append(f"{p}.folder_path: required (a folder of images with same-name caption files)")
    elif check_files:
        if not os.path.isdir(fp):
            e.append(f"{p}.folder_path: no such folder: {fp}")
        elif not _has_image(fp):
            e.append(f"{p}.folder_path: {fp} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return e


def _mask_problems(cfg, p, check_files):
    e, mp = [], cfg.mask_path
    if mp is not None and (not isinstance(mp, str) or not mp):
        e.append(f"{p}.mask_path: a folder of mask images, got {mp!r}")
    elif mp is not None and check_files and not os.path.isdir(mp):
        e.append(f"{p}.mask_path: no such folder: {mp}")
    if mp is not None and cfg.alpha_mask is True:
        e.append(f"{p}.alpha_mask: given together with mask_path; the mask comes from one of them")
    masked = mp is not None or cfg.alpha_mask is True
    v = cfg.mask_min_value
    if not _is_number(v) or not 0 <= v < 1:
        e.append(f"{p}.mask_min_value: a weight in [0, 1) for the mask's black, got {v!r}")
    elif v and not masked:
        e.append(f"{p}.mask_min_value: {v} but the dataset has no masks (give mask_path or alpha_mask: true)")
    if cfg.invert_mask is True and not masked:
        e.append(f"{p}.invert_mask: true but the dataset has no masks (give mask_path or alpha_mask: true)")
    return e


def _has_image(folder):
    return any(p.lower().endswith(IMAGE_EXTENSIONS) for p in walk_files(folder))
