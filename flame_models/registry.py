"""The model families FLAME knows: one line each, naming the family's folder. Nothing else in flame_models imports a
family; the trainer, `generate`, file detection and the VAE's latent formats ask here, and a family's code is
imported only when it is asked for (file detection asks every family).

A family's folder (docs/ARCHITECTURES.md: how to add one) holds
    about.py     ABOUT: an About -- its names, how its files are recognised, its latent format, its ai-toolkit flag
    family.py    its trainer plug-in (a training.family.ModelFamily subclass, named by About.trainer)
    generate.py  its part of `python -m flame_models.generate` (flame_models/generate.py says what it provides)
and its model, loading, keys and pipeline, which only the folder itself imports.
"""
import importlib
import json
import os
from dataclasses import dataclass

# name (model.arch, --arch) -> the family's package
FAMILIES = {
    "flux": "flame_models.flux",
    "sd3": "flame_models.sd3",
    "sdxl": "flame_models.sdxl",
    "flux_kontext": "flame_models.flux_kontext",
    "chroma": "flame_models.chroma",
    "qwen_image": "flame_models.qwen_image",
}


@dataclass(frozen=True)
class About:
    """What the registry knows of a family without loading its models.

    name              its key in FAMILIES (model.arch, --arch)
    label             its name in messages ("SD3 / SD3.5")
    model_words       its denoiser in a sentence ("an SD3 / SD3.5 MMDiT")
    header_kind       the kind its denoiser's file gets from its key names (checkpoint_io.describe_keys)
    file_words        such a file in a sentence ("a Stable Diffusion / SDXL UNet": an SD 1.x UNet has that kind too)
    key_marks         key suffixes that only its denoiser's files have (describe_keys: the first match wins)
    pipeline_classes  diffusers model_index.json `_class_name` prefixes of its pipeline folders
    latent_format     how it scales the VAE's latents (vae.LatentFormat)
    trainer           the ModelFamily class in its family.py
    toolkit_flag      ai-toolkit's model flag that selects it (model.is_flux / is_v3 / is_xl), or None
    refines           the family whose files its own files also look like (Chroma's carry Flux's block names,
                      Kontext's are Flux-dev's): its key marks are tried first, and with `--arch` naming it a file
                      of that family's header kind is accepted
    """
    name: str
    label: str
    model_words: str
    header_kind: str
    file_words: str
    key_marks: tuple
    pipeline_classes: tuple
    latent_format: object
    trainer: str
    toolkit_flag: str = None
    refines: str = None


def names():
    """The registered families' names, in registration order."""
    return tuple(FAMILIES)


def _package(name):
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; available: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def module(name, part):
    """The module `part` of family `name`'s folder ("family", "generate", ...), imported now."""
    return importlib.import_module(f"{_package(name)}.{part}")


def about(name):
    """The About of family `name` (imports its about.py)."""
    return module(name, "about").ABOUT


def trainer_class(name):
    """The trainer plug-in class (a training.family.ModelFamily) of family `name`."""
    return getattr(module(name, "family"), about(name).trainer)


def latent_format(name):
    """The LatentFormat of family `name`."""
    return about(name).latent_format


def toolkit_flags():
    """{ai-toolkit model flag: family name} (is_flux, is_v3, is_xl)."""
    return {a.toolkit_flag: a.name for a in map(about, FAMILIES) if a.toolkit_flag}


def _by_specificity():
    """The families' About, those refining another first (their marks are the more specific)."""
    abouts = [about(n) for n in FAMILIES]
    return [a for a in abouts if a.refines] + [a for a in abouts if not a.refines]


def key_kinds():
    """[(kind, words, key marks)] of every family's denoiser files, for describe_keys (the first match wins: a
    family refining another comes first; a family without marks of its own is left out)."""
    return [(a.header_kind, a.file_words, a.key_marks) for a in _by_specificity() if a.key_marks]


def detect_family(path, arch=None, error=ValueError, default=None):
    """(family name, what the files look like) of a model path: a diffusers folder (its model_index.json's pipeline
    class, else its transformer/ or unet/ subfolder's header) or a denoiser file (its header), asked of each
    family in turn. With `arch` given, the files must agree with it. Files of no family: (default, words) when a
    default is given (its loader then names what they are), else `error` naming the path."""
    abouts = _by_specificity()
    if arch is not None and arch not in FAMILIES:
        raise error(f"--arch {arch!r}: one of {', '.join(FAMILIES)}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise error(f"{path} does not exist")
    family, words, header = None, None, path
    if os.path.isdir(path):
        index = os.path.join(path, "model_index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    cls = str(json.load(f).get("_class_name", ""))
            except (OSError, ValueError, AttributeError) as e:
                raise error(f"{index}: not a readable model_index.json ({e})") from None
            matching = [(max(len(c) for c in a.pipeline_classes if cls.startswith(c)), a.name) for a in abouts
                        if cls.startswith(a.pipeline_classes)]
            family = max(matching)[1] if matching else None  # the longest prefix: FluxKontext... is not Flux
            words = f"a diffusers {cls or 'pipeline'} folder"
        header = next((os.path.join(path, s) for s in ("transformer", "unet") if os.path.isdir(os.path.join(path, s))),
                      path)
    if family is None:
        kind, words = _header_kind(header, error)
        family = next((a.name for a in abouts if a.header_kind == kind and a.key_marks), None)
        if arch is not None and family is not None and about(arch).refines == family \
                and about(arch).header_kind == kind:
            family = arch  # (a Kontext file is a Flux-dev file: --arch says which)
    if family is None and arch is None and default is not None:
        return default, words
    if family is None:
        labels = [a.label for a in abouts]
        raise error(f"{path} is not a {', '.join(labels[:-1])} or {labels[-1]} model: it looks like {words}"
                    + ("" if arch is None else f" (--arch {arch})"))
    if arch is not None and arch != family:
        raise error(f"--arch {arch}: {path} is not {about(arch).model_words}: it looks like {words}")
    return family, words


def _header_kind(path, error):
    from .conditioning.files import kind_of, part_files, read_headers
    files = part_files(path, "model", error=error)
    keys = list(read_headers(files, error=error))
    kind, words, example = kind_of(keys)
    return kind, words + (f" (keys such as {example})" if example else " (no tensors)")
