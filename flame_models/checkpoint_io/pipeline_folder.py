"""A trained denoiser written as a diffusers folder (ai-toolkit's `save.save_format: diffusers`): `<path>/<subfolder>/`
(config.json + diffusion_pytorch_model.safetensors, what `from_pretrained(path, subfolder=...)` reads) and, when the
run's base model is a diffusers pipeline folder (model_index.json), every other component it lists -- its VAE, text
encoders, tokenizers, scheduler -- and model_index.json beside it: a whole pipeline (`FluxPipeline.from_pretrained`,
FLAME's --model). The components are hard links to the base's files where the file system allows (no second copy of
a 9 GB T5), copies otherwise; only the denoiser is new.

    write_pipeline_folder("runs/x/x", "transformer", lambda d: save_flux(model, d, "diffusers"), base="FLUX.1-dev")

Nothing half-written is left: the folder is assembled beside its destination and renamed into place; an existing
folder at `path` (the same step written again) is replaced whole, as os.replace replaces a file.
"""
import glob
import os
import shutil

from flame_core.io import fsync_dir

from .finding import read_json


def pipeline_components(base):
    """The component folders a diffusers pipeline folder `base` lists in its model_index.json ({name: [library,
    class]} entries), or [] when `base` is not one."""
    if base is None or not os.path.isdir(base) or not os.path.isfile(os.path.join(base, "model_index.json")):
        return []
    index = read_json(os.path.join(base, "model_index.json"))
    return sorted(k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2
                  and v[0] is not None and os.path.isdir(os.path.join(base, k)))


def _link_or_copy(src, dst):
    try:
        # (the file itself: link(2) would link a symlink -- a Hugging Face snapshot's files are relative symlinks
        # to its blobs, which would dangle from another folder)
        os.link(os.path.realpath(src), dst)
    except OSError:   # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)
    return dst


def write_pipeline_folder(path, subfolder, write, base=None, extra=None, replace=()):
    """Write the denoiser with `write(folder)` into `path`/`subfolder`, with the base pipeline's other components
    beside it (see the module docstring); extra(folder): writes more into the folder being assembled (a family that
    converts a single-file base's other parts, or writes trained ones: SDXL), the components named in `replace` not
    taken from the base. Returns [path]."""
    path = os.fspath(path).rstrip(os.sep)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a folder; a diffusers model is a folder")
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{path}.partial-{os.getpid()}", f"{path}.old-{os.getpid()}"
    for stale in glob.glob(glob.escape(path) + ".partial-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)   # a process that died mid-write left them (one writer a folder)
    try:
        os.makedirs(tmp)
        write(os.path.join(tmp, subfolder))
        parts = [c for c in pipeline_components(base) if c != subfolder and c not in replace]
        for name in parts:
            shutil.copytree(os.path.join(base, name), os.path.join(tmp, name), copy_function=_link_or_copy)
        if parts:
            _link_or_copy(os.path.join(base, "model_index.json"), os.path.join(tmp, "model_index.json"))
        if extra is not None:
            extra(tmp)
        fsync_dir(tmp)
        if os.path.isdir(path):
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(old) and not os.path.exists(path):
            os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(parent)
    return [path]
