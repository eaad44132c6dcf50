"""Finding the parts of a Flux text-to-image model: the transformer, the VAE, CLIP-L, T5-XXL and their tokenizers.

    files = find_flux_files("FLUX.1-dev/")                                # a diffusers folder
    files = find_flux_files("flux1-dev.safetensors", vae="ae.safetensors", clip_l="clip_l.safetensors",
                            t5="t5xxl_fp8_e4m3fn.safetensors")           # ComfyUI / BFL single files

Only the safetensors headers are read (names, shapes): every part is checked to be what it is meant to be and to
fit the transformer (T5 width = context_in_dim, CLIP width = vec_in_dim, VAE latent channels x 4 = in_channels)
before anything is loaded, and ONE error lists every problem, naming each file and what it looks like.
"""
import os
from dataclasses import dataclass

from ..conditioning import files as _files
from ..conditioning.files import ModelFilesError
from .loading import FluxCheckpointError, read_flux_params
from .params import FluxParams

# diffusers FluxPipeline's subfolders
SUBFOLDERS = {"transformer": "transformer", "vae": "vae", "clip_l": "text_encoder", "t5": "text_encoder_2",
              "clip_tokenizer": "tokenizer", "t5_tokenizer": "tokenizer_2"}
# what each part is, in the words of checkpoint_io.describe_keys, and the option that names it
_WANT = {"transformer": ("flux", "a Flux transformer", "--model"),
         "vae": ("vae", "a VAE (autoencoder)", "--vae"),
         "clip_l": ("clip", "a CLIP text encoder (CLIP-L)", "--clip-l"),
         "t5": ("t5", "a T5 text encoder (T5-XXL)", "--t5")}


class FluxFilesError(ModelFilesError):
    """Parts of a Flux model that are missing, unreadable, of the wrong kind or that do not fit together; the
    message has one line per problem, each naming the file."""


@dataclass
class FluxFiles:
    """Where each part of a Flux model is. transformer / vae / clip_l / t5: a safetensors file, an index JSON or a
    folder; clip_tokenizer / t5_tokenizer: a tokenizer folder, or None for the vocabulary packaged with FLAME.
    params: the transformer's FluxParams (read from its headers by find_flux_files)."""
    transformer: str
    vae: str
    clip_l: str
    t5: str
    clip_tokenizer: str = None
    t5_tokenizer: str = None
    params: FluxParams = None

    @property
    def is_dev(self):
        """True when the transformer embeds the guidance strength (flux-dev); schnell-like otherwise."""
        return self.params is None or self.params.guidance_embed

    @property
    def t5_max_length(self):
        """T5 tokens per prompt: 512 for dev, 256 for schnell (what diffusers and BFL use)."""
        return 512 if self.is_dev else 256


# ----------------------------------------------------------------------------- one part's files and headers
def part_files(path, part):
    """The safetensors files of `part` at `path` (a file, an index JSON, a folder holding one checkpoint, or a
    diffusers model folder holding the part's subfolder). Raises FluxFilesError with one line."""
    return _files.part_files(path, part, subfolders=SUBFOLDERS, error=FluxFilesError)


def read_headers(files):
    """{tensor name: shape} of safetensors files (headers only). FluxFilesError when one cannot be read."""
    return _files.read_headers(files, error=FluxFilesError)


def _find(shapes, suffix):
    return next((s for k, s in shapes.items() if k.endswith(suffix)), None)


def part_width(part, shapes):
    """The width of a part that must agree with a Flux-derived transformer, from its header: CLIP's and T5's model
    width, the VAE's latent channels; None when the header does not show it."""
    key = {"clip_l": "token_embedding.weight", "t5": ".SelfAttention.q.weight", "vae": "decoder.conv_in.weight"}
    shape = _find(shapes, key[part]) if part in key else None
    return shape[1] if shape else None


# ----------------------------------------------------------------------------- the parts of a Flux-derived model
def locate_separate_parts(path, given, want, *, subfolders, error, read_params, param_errors):
    """Find the separate files of a Flux-derived model (Flux, Kontext, Chroma): `path` a diffusers folder or the
    transformer's file / folder, `given` {part: path or None} for the other parts, `want` {part: (describe_keys
    kind, words, option)} with the transformer first. A part not given comes from the folder's subfolder. Each is
    checked to be what it should be (headers only); the transformer's params are read with `read_params` (its
    errors, `param_errors`, become problems). Returns (root folder or None, {part: path}, {part: (shown name,
    width)}, params or None, problems)."""
    from ..checkpoint_io import describe_keys
    path = os.fspath(path)
    root = path if os.path.isdir(path) and os.path.isdir(os.path.join(path, "transformer")) else None
    given = dict(given, transformer=os.path.join(root, "transformer") if root else path)
    problems, found, widths = [], {}, {}
    for part, (kind, words, option) in want.items():
        where = given.get(part)
        if where is None:
            sub = os.path.join(root, subfolders[part]) if root else None
            if sub is None or not os.path.isdir(sub):
                problems.append(f"{part}: missing -- " + (f"{root} has no {subfolders[part]}/ folder; " if root else
                                f"{path} is a single transformer file; ") + f"pass {option} ({words})")
                continue
            where = sub
        try:
            files = _files.part_files(where, part, subfolders=subfolders, error=error)
            shapes = _files.read_headers(files, error=error)
        except error as e:
            problems.append(f"{part} ({option}): {e}")
            continue
        got, got_words, example = describe_keys(shapes)
        if got != kind:
            what = got_words + (f" (keys such as {example})" if example else " (no tensors)")
            problems.append(f"{part} ({option}): {_files.shown(where, files)} is not {words}: it looks like {what}")
            continue
        found[part] = os.fspath(where)
        widths[part] = (_files.shown(where, files), part_width(part, shapes))
    if "transformer" not in found:  # the parts it lacks are beside the point until the model itself is right
        problems = [p for p in problems if ": missing -- " not in p]
    params = None
    if "transformer" in found:
        try:
            params = read_params(found["transformer"])
        except param_errors as e:
            problems.append(f"transformer (--model): {found['transformer']}: {str(e).splitlines()[0]}")
    return root, found, widths, params, problems


def fit_problems(fits, widths, want, transformer):
    """The problems of parts whose width does not fit the transformer: `fits` {part: (width wanted, what, the
    transformer's field)}, `widths` as locate_separate_parts returns them, `want` its {part: (.., .., option)}."""
    problems = []
    for part, (expected, what, name) in fits.items():
        if part in widths and widths[part][1] is not None and widths[part][1] != expected:
            problems.append(f"{part} ({want[part][2]}): {widths[part][0]} has {what} {widths[part][1]}, but the "
                            f"transformer {transformer} expects {expected} ({name})")
    return problems


# ----------------------------------------------------------------------------- the whole model
def find_flux_files(path, *, vae=None, clip_l=None, t5=None, tokenizer=None):
    """FluxFiles for a Flux model: `path` a diffusers Flux folder (transformer/, vae/, text_encoder/,
    text_encoder_2/, tokenizer/, tokenizer_2/) or a transformer file / folder (BFL, ComfyUI, diffusers
    `transformer/`); `vae`, `clip_l`, `t5` name the parts a single file lacks (or replace a folder's);
    `tokenizer` a folder holding tokenizer/ (CLIP) and tokenizer_2/ (T5) -- default: the model folder's, else the
    vocabularies packaged with FLAME. Reads headers only; raises FluxFilesError listing every problem."""
    root, found, widths, params, problems = locate_separate_parts(
        path, {"vae": vae, "clip_l": clip_l, "t5": t5}, _WANT, subfolders=SUBFOLDERS, error=FluxFilesError,
        read_params=read_flux_params, param_errors=(FluxCheckpointError, KeyError, ValueError, OSError))
    if params is not None:
        problems += fit_problems({"clip_l": (params.vec_in_dim, "CLIP width", "vec_in_dim"),
                                  "t5": (params.context_in_dim, "T5 width (d_model)", "context_in_dim"),
                                  "vae": (params.in_channels // 4, "VAE latent channels", "in_channels / 4")},
                                 widths, _WANT, found["transformer"])
    toks = {}
    for part, want in (("clip_tokenizer", "bpe"), ("t5_tokenizer", "unigram")):
        toks[part] = _tokenizer_folder(tokenizer if tokenizer is not None else root, part, want,
                                       tokenizer is not None, problems)
    _files.report(problems, "Flux model", os.fspath(path), FluxFilesError)
    return FluxFiles(found["transformer"], found["vae"], found["clip_l"], found["t5"], toks["clip_tokenizer"],
                     toks["t5_tokenizer"], params)


def _tokenizer_folder(base, part, want, explicit, problems):
    """The tokenizer folder for `part` under `base` (conditioning.files.tokenizer_folder with Flux's subfolders)."""
    return _files.tokenizer_folder(base, part, want, explicit, problems, subfolder=SUBFOLDERS[part])
