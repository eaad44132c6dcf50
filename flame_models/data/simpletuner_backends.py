"""SimpleTuner's data backend config (`multidatabackend.json`, its --data_backend_config) read as FLAME's datasets.

    datasets, notes, held_out = read_backends("config/multidatabackend.json", defaults)

`defaults`: the config.json values a backend falls back to (resolution, resolution_type, minimum_image_size,
maximum_image_size, target_downsample_size, caption_strategy, instance_prompt, prepend_instance_prompt,
only_instance_prompt, caption_dropout_probability; training/simpletuner_config.py gives them with SimpleTuner's
defaults filled in).

An image backend (`dataset_type` image, the default; `type: local`) -> one FLAME dataset:
    instance_data_dir -> folder_path (as given, else beside the JSON file when it is there)
    caption_strategy textfile -> the .txt caption files; a multi-line file trains on one of its lines per sample
        (caption_lines random, as SimpleTuner picks one; disable_multiline_split: the whole text)
    caption_strategy filename -> caption_from filename (the name, "_" read as spaces; SimpleTuner's default)
    caption_strategy instanceprompt, or only_instance_prompt -> every image's caption is instance_prompt
        (caption_from default_caption); prepend_instance_prompt -> caption_prefix instance_prompt
    repeats N -> num_repeats N + 1 (SimpleTuner's 0 means each image once per epoch)
    resolution with resolution_type pixel_area -> resolution (buckets of about resolution² pixels); area (megapixels)
        -> the side whose square holds them, to the nearest 64 px (said in a note when it is not exact); pixel ->
        resolution with resolution_mode short_side (the shorter side at resolution, the longer one a multiple of 64)
    crop true -> crop_aspect square: square crops (max_aspect 1), preserve: aspect buckets; crop_style random ->
        random_crop, center / centre -> centred crops
    minimum_image_size 0 / unset -> allow_upscale (SimpleTuner upscales a small image into its bucket); equal to the
        resolution -> images smaller than their bucket are left out (FLAME's rule, said in a note)
    caption_dropout_probability (config.json) -> caption_dropout_rate
    is_regularisation_data -> prior_reg (toward the adapter-free model's prediction, as SimpleTuner's LoRA runs do)
    conditioning_data (Flux Kontext) -> control_path: the instance_data_dir of the `conditioning` backend it names
        (conditioning_type reference_strict: the control image of the same name)
One `eval` backend -> the held-out folder of FLAME's validation loss (read with the first image backend's caption
and bucket settings, so its own must agree; config.json's eval_steps_interval / eval_timesteps / num_eval_images say
when and how: training/simpletuner_config.py).
Notes, changing nothing FLAME trains on: text_embeds backends and an image backend's text_embeds id (FLAME encodes
every caption once itself), cache_dir_vae, metadata_backend discovery / json, skip_file_discovery,
preserve_data_backend_cache, hash_filenames, disabled backends (skipped), maximum_image_size /
target_downsample_size without crops or equal to the resolution (FLAME resizes each image to its bucket in one step).
Every other key or value -- other backend types (aws, csv, huggingface, ...), caption strategies parquet / csv,
a probability other than 1, several eval datasets, video datasets,
random crops re-drawn each epoch (vae_cache_clear_each_epoch), ... -- is an error naming the file, the backend and
the key: a setting FLAME would not apply is never dropped silently.
"""
import json
import math
import os

from .errors import DataError

MAX_BYTES = 1 << 20   # a backend list is a few kilobytes

_NOTED = {
    "cache_dir_vae": "FLAME caches latents itself (in host memory, or cache_latents_to_disk beside the images)",
    "text_embeds": "FLAME encodes every caption once before training (its own text cache)",
    "metadata_backend": "FLAME probes each image's header itself",
    "skip_file_discovery": "FLAME scans the folder on every run (probes are kept between runs)",
    "preserve_data_backend_cache": "FLAME keeps its probes between runs",
    "hash_filenames": "FLAME names its cache entries itself",
    "id": None, "type": None, "dataset_type": None, "disabled": None, "disable": None,
}
_IMAGE_KEYS = {"instance_data_dir", "caption_strategy", "instance_prompt", "prepend_instance_prompt",
               "only_instance_prompt", "disable_multiline_split", "repeats", "probability", "resolution",
               "resolution_type", "minimum_image_size", "maximum_image_size", "target_downsample_size", "crop",
               "crop_style", "crop_aspect", "vae_cache_clear_each_epoch", "conditioning_data",
               "is_regularisation_data", "is_regularization_data", "caption_dropout_probability"}


class SimpleTunerConfigError(DataError):
    """A SimpleTuner backend config FLAME cannot read exactly (the message names the file, backend and key)."""


def read_json(path, error, what):
    """The parsed JSON at `path` (at most MAX_BYTES), or `error` naming the file."""
    if not os.path.isfile(path):
        raise error(f"{path}: no such file ({what})")
    if os.path.getsize(path) > MAX_BYTES:
        raise error(f"{path}: {os.path.getsize(path)} bytes; {what} is a few kilobytes")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{path}: not a JSON file ({e})") from None


def read_backends(path, defaults):
    """([FLAME dataset dicts], notes, the eval backend's held-out folder {folder_path[, control_path]} or None) from
    SimpleTuner's backend list at `path`; SimpleTunerConfigError naming the file, backend and key of each setting
    FLAME would not apply as SimpleTuner does (module docstring)."""
    doc = read_json(path, SimpleTunerConfigError, "a data backend config")
    if not isinstance(doc, list) or not doc or not all(isinstance(b, dict) for b in doc):
        raise SimpleTunerConfigError(f"{path}: expected a list of backend objects (SimpleTuner's "
                                     f"multidatabackend.json)")
    notes, errors, images, evals, conditioning = [], [], [], [], {}
    for i, b in enumerate(doc):
        where = f"{path} backend #{i + 1}" + (f" ({b['id']})" if isinstance(b.get("id"), str) else "")
        if b.get("disabled") is True or b.get("disable") is True:
            notes.append(f"{where}: disabled: skipped")
            continue
        kind = b.get("dataset_type", "image")
        if kind == "text_embeds":
            notes.append(f"{where}: a text_embeds backend: {_NOTED['text_embeds']}")
            continue
        if kind not in ("image", "conditioning", "eval"):
            errors.append(f"{where}: dataset_type {kind!r}: FLAME reads image backends (and Flux Kontext's "
                          f"conditioning ones, and one eval dataset)")
            continue
        if b.get("type", "local") != "local":
            errors.append(f"{where}: type {b.get('type')!r}: FLAME reads local folders (type local)")
            continue
        for k in b:
            if k not in _IMAGE_KEYS and k not in _NOTED and k != "conditioning_type":
                errors.append(f"{where}: {k}: not supported by FLAME's SimpleTuner reader "
                              f"(flame_models/data/simpletuner_backends.py lists what it reads)")
        if not isinstance(b.get("instance_data_dir"), str) or not b["instance_data_dir"]:
            errors.append(f"{where}: instance_data_dir: required (the folder of images)")
            continue
        folder = _near(b["instance_data_dir"], path)
        if kind == "conditioning":
            ctype = b.get("conditioning_type", "reference_strict")
            if ctype != "reference_strict":
                errors.append(f"{where}: conditioning_type {ctype!r}: FLAME pairs each edit with the control image "
                              f"of the same name (reference_strict)")
            conditioning[b.get("id")] = folder
            continue
        (evals if kind == "eval" else images).append((where, b, folder))
    datasets = [_image_backend(where, b, folder, defaults, conditioning, notes, errors)
                for where, b, folder in images]
    held_out = None
    if len(evals) > 1:
        errors.append(f"{path}: {len(evals)} eval backends: FLAME evaluates one held-out folder")
    elif evals and datasets:
        where, b, folder = evals[0]
        d = _image_backend(where, b, folder, defaults, conditioning, notes, errors)
        # FLAME reads held-out images with datasets[0]'s captions and buckets: the eval backend must say the same
        differ = sorted(k for k in set(d) | set(datasets[0])
                        if k not in ("folder_path", "num_repeats", "control_path")
                        and d.get(k) != datasets[0].get(k))
        if differ:
            errors.append(f"{where}: FLAME reads the held-out images with the first image backend's caption and "
                          f"bucket settings; this one differs in {', '.join(differ)}")
        held_out = {"folder_path": folder, **({"control_path": d["control_path"]} if "control_path" in d else {})}
    if not datasets and not errors:
        errors.append(f"{path}: no enabled image backend")
    if errors:
        raise SimpleTunerConfigError(f"{len(errors)} problem(s) in SimpleTuner's data backends:\n  "
                                     + "\n  ".join(errors))
    return datasets, notes, held_out


def _near(name, path):
    """A folder the backends name: as given (SimpleTuner reads it from its working folder), else beside the JSON
    file when it is there."""
    if not os.path.isabs(name) and not os.path.isdir(name):
        near = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        if os.path.isdir(near):
            return near
    return name


def _get(b, defaults, key):
    return b[key] if key in b else defaults.get(key)


def _image_backend(where, b, folder, defaults, conditioning, notes, errors):
    d = {"folder_path": folder}
    for k, why in _NOTED.items():
        if k in b and why is not None:
            notes.append(f"{where}: {k}: {why}")
    if b.get("is_regularisation_data") or b.get("is_regularization_data"):
        if defaults.get("model_type", "lora") == "lora":   # (SimpleTuner's parent-model target: LoRA runs only)
            d["prior_reg"] = True
            notes.append(f"{where}: is_regularisation_data: these images train toward the model's own prediction "
                         f"without the adapters (prior_reg), as SimpleTuner does")
        else:
            notes.append(f"{where}: is_regularisation_data with model_type full: trained like the other images, as "
                         f"SimpleTuner does")
    prob = b.get("probability", 1.0)
    if prob != 1 and prob != 1.0:
        errors.append(f"{where}: probability {prob!r}: FLAME draws every image of every dataset once per epoch "
                      f"(times its repeats), as SimpleTuner's default 1.0 does")
    repeats = b.get("repeats", 0)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        errors.append(f"{where}: repeats: an integer >= 0 (0: each image once per epoch), got {repeats!r}")
    elif repeats:
        d["num_repeats"] = repeats + 1
    _captions(where, b, defaults, d, notes, errors)
    rate = _get(b, defaults, "caption_dropout_probability")
    if rate:
        d["caption_dropout_rate"] = rate
    r = _resolution(where, b, defaults, notes, errors)
    if r is not None:
        d["resolution"] = r
        if _get(b, defaults, "resolution_type") == "pixel":
            d["resolution_mode"] = "short_side"
    _crop(where, b, d, r, defaults, notes, errors)
    if "conditioning_data" in b:
        ref = b["conditioning_data"]
        if isinstance(ref, list) and len(ref) == 1:
            ref = ref[0]
        if not isinstance(ref, str) or ref not in conditioning:
            errors.append(f"{where}: conditioning_data {ref!r}: names no conditioning backend of this file "
                          f"(one, with dataset_type conditioning)")
        else:
            d["control_path"] = conditioning[ref]
    return d


def _captions(where, b, defaults, d, notes, errors):
    strategy = _get(b, defaults, "caption_strategy") or "filename"
    prompt = _get(b, defaults, "instance_prompt")
    if prompt is not None and not isinstance(prompt, str):
        errors.append(f"{where}: instance_prompt: one text (FLAME does not draw from a list), got {prompt!r}")
        return
    if _get(b, defaults, "only_instance_prompt") or strategy == "instanceprompt":
        if not prompt:
            errors.append(f"{where}: caption_strategy instanceprompt (or only_instance_prompt) needs instance_prompt")
            return
        d["caption_from"], d["default_caption"] = "default_caption", prompt
        return
    if strategy == "textfile":
        d["caption_ext"] = "txt"
        d["caption_lines"] = "all" if b.get("disable_multiline_split") else "random"
    elif strategy == "filename":
        d["caption_from"] = "filename"
    else:
        errors.append(f"{where}: caption_strategy {strategy!r}: FLAME reads textfile, filename and instanceprompt")
        return
    if _get(b, defaults, "prepend_instance_prompt"):
        if not prompt:
            errors.append(f"{where}: prepend_instance_prompt needs instance_prompt")
        else:
            d["caption_prefix"] = prompt


def _resolution(where, b, defaults, notes, errors):
    r, kind = _get(b, defaults, "resolution"), _get(b, defaults, "resolution_type") or "pixel_area"
    if isinstance(r, bool) or not isinstance(r, (int, float)) or r <= 0:
        errors.append(f"{where}: resolution: a positive number, got {r!r}")
        return None
    if kind in ("pixel_area", "pixel"):   # (pixel: the shorter edge, resolution_mode short_side)
        if r != int(r) or int(r) % 64:
            errors.append(f"{where}: resolution {r}: FLAME's buckets are multiples of 64 px; give a multiple of 64")
            return None
        return int(r)
    if kind == "area":
        side = math.sqrt(r * 1e6)
        out = max(64, int(round(side / 64)) * 64)
        if abs(out - side) > 1e-6:
            notes.append(f"{where}: resolution {r} megapixels: buckets of {out}² pixels ({out * out / 1e6:.3f} MP; "
                         f"FLAME's sides are multiples of 64)")
        return out
    errors.append(f"{where}: resolution_type {kind!r}: FLAME reads pixel_area, area (megapixels) and pixel (the "
                  f"shorter edge)")
    return None


def _crop(where, b, d, r, defaults, notes, errors):
    crop = b.get("crop", False)
    if crop not in (True, False):
        errors.append(f"{where}: crop: true or false, got {crop!r}")
        return
    if crop:
        aspect, style = b.get("crop_aspect", "square"), b.get("crop_style", "random")
        if aspect == "square":
            d["max_aspect"] = 1.0
        elif aspect != "preserve":
            errors.append(f"{where}: crop_aspect {aspect!r}: FLAME crops to square or aspect buckets (square, "
                          f"preserve)")
        if style == "random":
            d["random_crop"] = True
            if b.get("vae_cache_clear_each_epoch"):
                errors.append(f"{where}: vae_cache_clear_each_epoch with random crops: FLAME draws a crop once per "
                              f"image and repeat, not again each epoch")
        elif style not in ("center", "centre"):
            errors.append(f"{where}: crop_style {style!r}: FLAME crops at random or centred (random, center)")
    elif b.get("vae_cache_clear_each_epoch"):
        notes.append(f"{where}: vae_cache_clear_each_epoch: the same latents come back without random crops")
    px = None if r is None else (r if _get(b, defaults, "resolution_type") in (None, "pixel_area", "pixel") else None)
    for k in ("maximum_image_size", "target_downsample_size"):
        v = _get(b, defaults, k)
        if v is None:
            continue
        if crop and v != px:
            errors.append(f"{where}: {k} {v} with crops: FLAME crops from the image resized to its bucket "
                          f"(SimpleTuner's {k} equal to the resolution)")
        else:
            notes.append(f"{where}: {k}: FLAME resizes each image to its bucket in one step")
    small = _get(b, defaults, "minimum_image_size")
    if not small:
        d["allow_upscale"] = True   # SimpleTuner upscales a smaller image into its bucket
    elif px is not None and small == px:
        notes.append(f"{where}: minimum_image_size {small}: FLAME leaves out each image smaller than its bucket "
                     f"(said in a warning)")
    else:
        errors.append(f"{where}: minimum_image_size {small}: FLAME either upscales small images (0 / unset) or "
                      f"leaves out those smaller than their bucket (minimum_image_size = the resolution)")
