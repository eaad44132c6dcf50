"""kohya sd-scripts' dataset config (`--dataset_config dataset.toml`) read as FLAME's datasets: the `[general]`
settings, each `[[datasets]]` entry's over them and each `[[datasets.subsets]]` entry's over those (kohya's
precedence), one FLAME dataset per subset.

    datasets, batch_size, notes = read_dataset_config("dataset.toml")    # (the command line's --dataset-config)

kohya key -> FLAME dataset field:
    image_dir -> folder_path              caption_extension -> caption_ext     shuffle_caption -> shuffle_tokens
    keep_tokens, caption_separator, num_repeats, is_reg, random_crop, caption_dropout_rate, alpha_mask,
    min_bucket_reso, max_bucket_reso, caption_prefix, caption_suffix, keep_tokens_separator,
    caption_tag_dropout_rate, secondary_separator, caption_dropout_every_n_epochs, enable_wildcard (the same names)
    (none) -> caption_lines = "random" with enable_wildcard, else "first": kohya trains on one line of a multi-line
                                           caption file (a random one with wildcards on, else the first)
    class_tokens -> default_caption       (kohya's DreamBooth caption of an image without a caption file)
    resolution (N or [N, N]) -> resolution
    bucket_reso_steps -> bucket_tolerance
    bucket_no_upscale -> allow_upscale = not it (kohya upscales a smaller image into its bucket unless told not to)
    flip_aug -> flip_x                    (kohya flips each image at random per step; FLAME adds its mirror image to
                                           every epoch: both orientations seen equally often, the epoch twice as long
                                           -- said in the notes)
    enable_bucket = true -> aspect-ratio buckets; false, or not set (kohya's default: its --enable_bucket is off
    unless given) -> max_aspect = 1: every image cropped to the square resolution, as kohya trains without buckets
    cache_latents_to_disk -> cache_latents_to_disk; cache_latents (FLAME always caches) is accepted
    batch_size (per [[datasets]]) -> train.batch_size: one for the run, so the entries must agree

Every other key -- color_aug, face_crop_aug_range, token_warmup_*, metadata_file (fine-tuning
JSON), conditioning_data_dir, a non-square resolution, ... -- is an error naming the file, the
entry and the key: a setting FLAME would not apply is never dropped silently. The file is parsed with Python's tomllib.
"""
import os

from .errors import DataError

# kohya key -> FLAME DatasetConfig field, taken as they are (types checked by the dataset config's validation)
_SAME = {"image_dir": "folder_path", "caption_extension": "caption_ext", "shuffle_caption": "shuffle_tokens",
         "keep_tokens": "keep_tokens", "caption_separator": "caption_separator", "num_repeats": "num_repeats",
         "is_reg": "is_reg", "random_crop": "random_crop", "caption_dropout_rate": "caption_dropout_rate",
         "alpha_mask": "alpha_mask", "min_bucket_reso": "min_bucket_reso", "max_bucket_reso": "max_bucket_reso",
         "class_tokens": "default_caption", "bucket_reso_steps": "bucket_tolerance", "flip_aug": "flip_x",
         "cache_latents_to_disk": "cache_latents_to_disk", "caption_prefix": "caption_prefix",
         "caption_suffix": "caption_suffix", "keep_tokens_separator": "keep_tokens_separator",
         "caption_tag_dropout_rate": "caption_tag_dropout_rate", "secondary_separator": "secondary_separator",
         "caption_dropout_every_n_epochs": "caption_dropout_every_n_epochs", "enable_wildcard": "enable_wildcard"}
_SPECIAL = ("resolution", "bucket_no_upscale", "batch_size", "enable_bucket", "cache_latents")


class KohyaConfigError(DataError):
    """A kohya dataset config FLAME cannot read exactly (the message names the file, entry and key)."""


def _check_keys(table, where, allowed):
    bad = [k for k in table if k not in allowed]
    if bad:
        raise KohyaConfigError(f"{where}: {', '.join(sorted(bad))}: not supported by FLAME's datasets (it reads "
                               f"{', '.join(sorted(k for k in _SAME))}, {', '.join(_SPECIAL)}; see "
                               f"flame_models/data/kohya_toml.py)")


def _resolution(v, where):
    if isinstance(v, bool):
        raise KohyaConfigError(f"{where}.resolution: a number of pixels or [width, height], got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        if v[0] != v[1]:
            raise KohyaConfigError(f"{where}.resolution: {v} is not square; FLAME's buckets keep the area of a "
                                   f"square resolution (give [{max(v)}, {max(v)}] or the side whose square you mean)")
        return v[0]
    raise KohyaConfigError(f"{where}.resolution: a number of pixels or [width, height], got {v!r}")


def read_toml(path, error=None, size_words="a dataset config is a few hundred"):
    """The mapping of a kohya TOML file at `path` (someone else's: at most 1 MiB, read with tomllib); `error` (default
    KohyaConfigError) names the file when it is missing, too large or not TOML."""
    import tomllib
    error = error or KohyaConfigError
    if not os.path.isfile(path):
        raise error(f"{path}: no such file")
    if os.path.getsize(path) > 1 << 20:
        raise error(f"{path}: {os.path.getsize(path):,} bytes; {size_words}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not a TOML file: {e}") from None


def read_dataset_config(path, enable_bucket=False):
    """(FLAME dataset dicts, the batch size or None, notes) from kohya's dataset TOML at `path`. enable_bucket: the
    value of a subset that does not set it (kohya's --enable_bucket; off by default, as in kohya). KohyaConfigError
    for anything FLAME would not apply as kohya does (module docstring)."""
    doc = read_toml(path)
    _check_keys(doc, path, ("general", "datasets"))
    general = doc.get("general", {})
    entries = doc.get("datasets", [])
    allowed = set(_SAME) | set(_SPECIAL)
    if isinstance(general, dict):
        _check_keys(general, f"{path} [general]", allowed - {"image_dir"})
    if not isinstance(general, dict) or not isinstance(entries, list) or not entries:
        raise KohyaConfigError(f"{path}: expected a [general] table and at least one [[datasets]] entry with "
                               f"[[datasets.subsets]]")
    out, sizes, notes, square = [], set(), [], False
    for i, entry in enumerate(entries):
        where = f"{path} [[datasets]] #{i + 1}"
        if not isinstance(entry, dict):
            raise KohyaConfigError(f"{where}: expected a table")
        _check_keys(entry, where, (allowed - {"image_dir"}) | {"subsets"})
        subsets = entry.get("subsets", [])
        if not isinstance(subsets, list) or not subsets:
            raise KohyaConfigError(f"{where}: no [[datasets.subsets]] (each names an image_dir)")
        for j, sub in enumerate(subsets):
            sw = f"{where} subset #{j + 1}"
            if not isinstance(sub, dict):
                raise KohyaConfigError(f"{sw}: expected a table")
            _check_keys(sub, sw, allowed - {"batch_size", "resolution", "enable_bucket", "min_bucket_reso",
                                            "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale"})
            merged = {**general, **{k: v for k, v in entry.items() if k != "subsets"}, **sub}
            if "image_dir" not in merged:
                raise KohyaConfigError(f"{sw}: no image_dir")
            bucket = merged.get("enable_bucket", enable_bucket)
            if not isinstance(bucket, bool):
                raise KohyaConfigError(f"{sw}.enable_bucket: true or false, got {bucket!r}")
            d = {_SAME[k]: v for k, v in merged.items() if k in _SAME}
            if not bucket:   # kohya without buckets: every image cropped to the square resolution
                d["max_aspect"] = 1.0
                if not square:
                    notes.append(f"{sw}: enable_bucket off (kohya's default unless a dataset or the arguments set it): "
                                 f"every image is cropped to the square resolution, as kohya trains without buckets")
                square = True
            if "resolution" in merged:
                d["resolution"] = _resolution(merged["resolution"], sw)
            if not isinstance(merged.get("bucket_no_upscale", False), bool):
                raise KohyaConfigError(f"{sw}.bucket_no_upscale: true or false, got {merged['bucket_no_upscale']!r}")
            d["allow_upscale"] = not merged.get("bucket_no_upscale", False)
            d["caption_lines"] = "random" if merged.get("enable_wildcard") is True else "first"
            if "batch_size" in merged:
                sizes.add(merged["batch_size"])
            out.append(d)
            if d.get("flip_x"):
                notes.append(f"{sw}: flip_aug: FLAME adds every image's mirror image to each epoch (kohya flips at "
                             f"random): both orientations as often, an epoch twice as long")
    if len(sizes) > 1:
        raise KohyaConfigError(f"{path}: [[datasets]] entries with batch sizes {sorted(sizes)}; FLAME trains every "
                               f"dataset at one train.batch_size")
    return out, (sizes.pop() if sizes else None), notes
