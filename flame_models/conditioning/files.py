"""Finding the parts of a text-to-image model (its transformer or UNet, VAE, text encoders, tokenizers) from the
safetensors headers alone: nothing is loaded until every part has been checked, and one error lists every problem.

A part is a file, a sharded index, a folder, a diffusers pipeline folder's subfolder -- or a key prefix inside a
single file that holds several models (SAI / ComfyUI checkpoints: `first_stage_model.` VAE, `text_encoders.clip_l.
transformer.` (SD3), `conditioner.embedders.1.model.` (SDXL's OpenCLIP CLIP-G), ...). Used by the Flux, SD3 and SDXL
pipelines' find_*_files.
"""
import os
from dataclasses import dataclass

from flame_core.errors import FlameError
from flame_core.io import safe_open

from ..checkpoint_io import INDEX_SUFFIX, index_files

_PREFERRED = ("diffusion_pytorch_model.safetensors", "model.safetensors")
_PICKLES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")


class ModelFilesError(FlameError, ValueError):
    """Parts of a model that are missing, unreadable, of the wrong kind or that do not fit together; the message has
    one line per problem, each naming the file."""


# ----------------------------------------------------------------------------- one part's files and headers
def part_files(path, part, *, subfolders=None, error=ModelFilesError):
    """The safetensors files of `part` at `path` (a file, an index JSON, a folder holding one checkpoint, or a
    diffusers model folder holding the part's subfolder, `subfolders[part]`). Raises `error` with one line."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise error(f"{path} does not exist")
    if os.path.isdir(path):
        names = os.listdir(path)
        sub = os.path.join(path, (subfolders or {}).get(part, part))
        if os.path.isdir(sub) and not any(n.endswith(".safetensors") for n in names):
            return part_files(sub, part, subfolders=subfolders, error=error)
        indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
        if len(indexes) > 1:
            raise error(f"{path}: several index files ({', '.join(indexes)}); name one of them")
        if indexes:
            return part_files(os.path.join(path, indexes[0]), part, subfolders=subfolders, error=error)
        st = sorted(n for n in names if n.endswith(".safetensors"))
        pick = next((n for n in _PREFERRED if n in st), None)
        if pick is None and len(st) == 1:
            pick = st[0]
        if pick is None:
            raise error(f"{path}: a folder with " + (f"{len(st)} .safetensors files ({', '.join(st[:5])}): "
                                                     f"name the file" if st else "no .safetensors file"))
        return [os.path.join(path, pick)]
    low = path.lower()
    if low.endswith(_PICKLES):
        raise error(f"{path}: a pickle checkpoint ({os.path.splitext(path)[1]}); only .safetensors files are read "
                    f"(they cannot run code when opened)")
    if low.endswith(".gguf"):
        raise error(f"{path}: a GGUF file; FLAME reads .safetensors checkpoints (fp8 storage: --fp8)")
    if low.endswith(".json"):
        return index_files(path, error)
    return [path]


def read_headers(files, *, error=ModelFilesError):
    """{tensor name: shape} of safetensors files (headers only). `error` when one cannot be read."""
    shapes = {}
    for f in files:
        try:
            with safe_open(f) as h:
                for k in h.keys():
                    shapes[k] = tuple(h.shape(k))
        except Exception as e:  # a truncated download, an HTML error page saved as .safetensors, a pickle
            first = str(e).splitlines()[0] if str(e) else ""
            raise error(f"{f}: not a readable .safetensors file ({type(e).__name__}: {first})") from None
    return shapes


def shown(path, files):
    """How to name a part in a message: its one file, else the path given."""
    return files[0] if len(files) == 1 else os.fspath(path)


def kind_of(keys):
    """(kind, words, an example key) of a file's tensor names: training.model_files.describe_keys' kinds, with
    text encoders in any layout flame_models.text_encoders reads (OpenCLIP's CLIP-G included)."""
    from ..text_encoders.layouts import find_encoders
    from ..training.model_files import describe_keys  # (lazy: training imports the model packages)
    kind, words, example = describe_keys(keys)
    if kind == "unknown":
        enc = find_encoders(keys)
        if enc:
            what = {"clip": "a CLIP text encoder", "t5": "a T5 text encoder"}[enc[0].kind]
            key = next((k for k in keys if k.startswith(enc[0].prefix)), example)
            return enc[0].kind, what, key
    return kind, words, example


# ----------------------------------------------------------------------------- parts inside one file
@dataclass(frozen=True)
class Embedded:
    """A model inside a single file: its kind ("vae", "clip", "t5"), key prefix and, for text encoders, the
    layout (flame_models.text_encoders.layouts)."""
    kind: str
    prefix: str
    layout: str = None


def embedded_parts(keys):
    """Every VAE and text encoder inside a file's key set (SAI / ComfyUI checkpoints), as Embedded."""
    from ..text_encoders.layouts import find_encoders
    keys = list(keys)
    found = [Embedded(c.kind, c.prefix, c.layout) for c in find_encoders(keys)]
    for k in keys:
        if k.endswith("decoder.conv_in.weight"):
            found.append(Embedded("vae", k[:-len("decoder.conv_in.weight")]))
    return found


def clip_facts(shapes, prefix="", layout=None):
    """{"width", "vocab", "pooled" (the pooled vector's width: the projection's when there is one, else the width),
    "projection" (bool)} of the CLIP text encoder under `prefix` in a header, or {} when it is not there."""
    from ..text_encoders.layouts import find_encoders
    if layout is None:
        cand = next((c for c in find_encoders(list(shapes)) if c.kind == "clip" and c.prefix == prefix), None)
        if cand is None:
            return {}
        layout = cand.layout
    emb = {"clip-hf": "text_model.embeddings.token_embedding.weight",
           "clip-flat": "embeddings.token_embedding.weight", "clip-openclip": "token_embedding.weight"}[layout]
    vocab, width = shapes[prefix + emb]
    if layout == "clip-openclip":
        proj = shapes.get(prefix + "text_projection")
        pooled = proj[1] if proj is not None else width              # OpenCLIP stores it (in, out)
    else:
        proj = shapes.get(prefix + "text_projection.weight")
        pooled = proj[0] if proj is not None else width
    return {"width": width, "vocab": vocab, "pooled": pooled, "projection": proj is not None}


def t5_facts(shapes, prefix=""):
    """{"width", "vocab"} of the T5 encoder under `prefix`, or {}."""
    emb = shapes.get(prefix + "shared.weight") or shapes.get(prefix + "encoder.embed_tokens.weight")
    return {"vocab": emb[0], "width": emb[1]} if emb else {}


def vae_latent_channels(shapes, prefix=""):
    conv = shapes.get(prefix + "decoder.conv_in.weight")
    return conv[1] if conv else None


def found_clip_facts(found, parts=("clip_l", "clip_g")):
    """{part: clip_facts} of the CLIP `parts` among the Located parts `found` (locate_parts); {} for one whose
    header holds no CLIP encoder where expected."""
    return {part: clip_facts(found[part].shapes, found[part].prefix, found[part].layout) for part in parts
            if part in found}


def vae_channel_problems(found, channels, model, others):
    """[] or the one problem of a found VAE whose latents do not have the `model`'s `channels` (`others`: the
    families whose VAE it may be instead, e.g. "a Flux / SD3 VAE has 16")."""
    vae = found.get("vae")
    z = vae_latent_channels(vae.shapes, vae.prefix) if vae is not None else None
    if z is None or z == channels:
        return []
    return [f"vae (--vae): {vae.shown} has {z} latent channels, but the {model} expects {channels} ({others})"]


# ----------------------------------------------------------------------------- tokenizers
def tokenizer_folder(base, part, want, explicit, problems, *, subfolder, option="--tokenizer"):
    """The tokenizer folder for `part` under `base` (a folder holding `subfolder`, e.g. tokenizer_2/, or the
    tokenizer folder itself when only one kind is in it); None (the vocabulary packaged with FLAME) when `base` is
    None or, not `explicit`, when `base` has no such folder. Problems are appended to `problems`."""
    from ..tokenization.files import model_type
    if base is None:
        return None
    base = os.fspath(base)
    label = "CLIP" if want == "bpe" else "T5"
    if not os.path.isdir(base):
        problems.append(f"{part} ({option}): {base} is not a folder (a diffusers model folder with {subfolder}/, "
                        f"or a tokenizer folder)")
        return None
    for folder in (os.path.join(base, subfolder), base):
        if not os.path.isdir(folder):
            continue
        try:
            kind = model_type(folder)
        except (ValueError, OSError) as e:
            problems.append(f"{part} ({option}): {e}")
            return None
        if kind == want:
            return folder
        if kind is not None and folder != base:
            problems.append(f"{part} ({option}): {folder} holds {kind} tokenizer files, not a {label} tokenizer")
            return None
    if explicit:
        problems.append(f"{part} ({option}): no {label} tokenizer in {base} (expected {subfolder}/ with "
                        + ("vocab.json + merges.txt or tokenizer.json)" if want == "bpe"
                           else "tokenizer.json or spiece.model)"))
    return None


def check_vocabulary(part, tokenizer, rows, where, error=ModelFilesError, option="--tokenizer"):
    """Every id `tokenizer` can produce must have one of the encoder's `rows` embedding rows (a packaged vocabulary
    with a small model would otherwise fail mid-encoding); checked on the headers, before any weight is read."""
    if rows is not None and tokenizer.vocab_size > rows:
        raise error(f"{part}: the tokenizer ({tokenizer.source}) has {tokenizer.vocab_size} tokens but the encoder "
                    f"{where} embeds only {rows}: pass the model's own tokenizer folder ({option})")


# ----------------------------------------------------------------------------- the whole model
def report(problems, what, path, error=ModelFilesError):
    """Raise `error` listing `problems` (one line each) about the model `what` at `path`; nothing when empty."""
    if len(problems) == 1:
        raise error(f"the {what} {path}: {problems[0]}")
    if problems:
        raise error(f"the {what} {path} is incomplete or mixes parts ({len(problems)} problems):\n  "
                    + "\n  ".join(problems))


# ----------------------------------------------------------------------------- locating every part
@dataclass(frozen=True)
class PartSpec:
    """What one part of a model must be: `kind` (kind_of's word: "sd3", "unet", "vae", "clip", "t5"), how to name it
    (`words`) and the option that gives it, its diffusers subfolder, the key prefixes under which a single file
    carries it (`embedded`, e.g. ("first_stage_model.",)), and whether the model runs without it."""
    kind: str
    words: str
    option: str
    subfolder: str
    embedded: tuple = ()
    optional: bool = False


@dataclass(frozen=True)
class Located:
    """One part found: `path` (file, index JSON or folder, as given or found), its files and header {key: shape},
    and the key prefix and layout of the part inside them ("" for a bare file; layout for text encoders)."""
    path: str
    files: tuple
    shapes: dict
    prefix: str = ""
    layout: str = None

    @property
    def shown(self):
        return shown(self.path, list(self.files))


def _inside(keys, spec, path, files, shapes):
    """The part `spec` inside a file holding several models, under one of its known prefixes, or None."""
    for e in embedded_parts(keys):
        if e.kind == spec.kind and any(e.prefix.startswith(root) for root in spec.embedded):
            return Located(path, tuple(files), shapes, e.prefix, e.layout)
    return None


def locate_parts(path, given, specs, *, main, error=ModelFilesError):
    """Find every part of a model. `path`: a diffusers folder (holding specs[main].subfolder) or the main part's file
    / folder; `given`: {part: path or None} from the user; `specs`: {part: PartSpec} (main first). A part not given
    comes from the diffusers folder's subfolder, else from inside the main file (SAI / ComfyUI single files), else
    is missing (a problem unless optional). Returns (root folder or None, {part: Located}, problems)."""
    path = os.fspath(path)
    sub = specs[main].subfolder
    root = path if os.path.isdir(path) and os.path.isdir(os.path.join(path, sub)) else None
    problems, found = [], {}
    main_keys = None
    for part, spec in specs.items():
        where = given.get(part) if part != main else (os.path.join(root, sub) if root else path)
        if where is None and root is not None and os.path.isdir(os.path.join(root, spec.subfolder)):
            where = os.path.join(root, spec.subfolder)
        if where is None:
            inside = _inside(main_keys, spec, found[main].path, found[main].files, found[main].shapes) \
                if main in found else None
            if inside is not None:
                found[part] = inside
            elif not spec.optional and main in found:
                problems.append(f"{part}: missing -- " + (f"{root} has no {spec.subfolder}/ folder" if root else
                                f"{path} does not hold one") + f"; pass {spec.option} ({spec.words})")
            continue
        where = os.fspath(where)
        try:
            files = part_files(where, part, subfolders={part: spec.subfolder}, error=error)
            shapes = read_headers(files, error=error)
        except error as e:
            problems.append(f"{part} ({spec.option}): {e}")
            continue
        keys = list(shapes)
        kind, words, example = kind_of(keys)
        if part == main:
            main_keys = keys
        mine = [e for e in embedded_parts(keys) if e.kind == spec.kind] if spec.kind in ("clip", "t5", "vae") else []
        if kind == spec.kind and len(mine) <= 1:
            e = mine[0] if mine else None
            found[part] = Located(where, tuple(files), shapes, e.prefix if e else "", e.layout if e else None)
            continue
        inside = _inside(keys, spec, where, files, shapes) if spec.embedded else None
        if inside is not None:  # a whole checkpoint (or a file of several encoders) given for one of its parts
            found[part] = inside
            continue
        if kind == spec.kind:
            problems.append(f"{part} ({spec.option}): {shown(where, files)} holds {len(mine)} of them (under "
                            f"{', '.join(repr(e.prefix) for e in mine)}); none is where {spec.words} is expected "
                            f"({', '.join(spec.embedded) or 'a file of its own'})")
            continue
        what = words + (f" (keys such as {example})" if example else " (no tensors)")
        problems.append(f"{part} ({spec.option}): {shown(where, files)} is not {spec.words}: it looks like {what}")
    if main not in found:  # the parts it lacks are beside the point until the model itself is right
        problems = [p for p in problems if ": missing -- " not in p]
    return root, found, problems
