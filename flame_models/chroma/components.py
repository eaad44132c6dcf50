"""Finding the parts of a Chroma model: the transformer, the Flux VAE, T5-XXL and its tokenizer.

    files = find_chroma_files("Chroma1-HD/")                                  # a diffusers ChromaPipeline folder
    files = find_chroma_files("chroma-unlocked-v50.safetensors", vae="ae.safetensors",
                              t5="t5xxl_fp16.safetensors")                     # Chroma / ComfyUI single files

Only headers are read: every part is checked to be what it should be and to fit the transformer (T5 width =
context_in_dim, VAE latent channels x 4 = in_channels), and ONE error lists every problem."""
import os
from dataclasses import dataclass

from ..conditioning import files as _files
from ..conditioning.files import ModelFilesError
from .loading import ChromaCheckpointError, read_chroma_params
from .params import ChromaParams

# diffusers ChromaPipeline's subfolders
SUBFOLDERS = {"transformer": "transformer", "vae": "vae", "t5": "text_encoder", "t5_tokenizer": "tokenizer"}
_WANT = {"transformer": ("chroma", "a Chroma transformer", "--model"),
         "vae": ("vae", "a VAE (autoencoder)", "--vae"),
         "t5": ("t5", "a T5 text encoder (T5-XXL)", "--t5")}
T5_MAX_LENGTH = 512


class ChromaFilesError(ModelFilesError):
    """Parts of a Chroma model that are missing, unreadable, of the wrong kind or that do not fit together; one line
    per problem, each naming the file."""


@dataclass
class ChromaFiles:
    """Where each part of a Chroma model is (a safetensors file, an index JSON or a folder; the tokenizer a folder,
    or None for the T5 vocabulary packaged with FLAME). params: the transformer's ChromaParams."""
    transformer: str
    vae: str
    t5: str
    t5_tokenizer: str = None
    params: ChromaParams = None
    t5_max_length: int = T5_MAX_LENGTH


def part_files(path, part):
    return _files.part_files(path, part, subfolders=SUBFOLDERS, error=ChromaFilesError)


def read_headers(files):
    return _files.read_headers(files, error=ChromaFilesError)


def _find(shapes, suffix):
    return next((s for k, s in shapes.items() if k.endswith(suffix)), None)


def _width(part, shapes):
    if part == "t5":
        q = _find(shapes, ".SelfAttention.q.weight")
        return q[1] if q else None
    if part == "vae":
        conv = _find(shapes, "decoder.conv_in.weight")
        return conv[1] if conv else None
    return None


def find_chroma_files(path, *, vae=None, t5=None, tokenizer=None):
    """ChromaFiles: `path` a diffusers Chroma folder (transformer/, vae/, text_encoder/, tokenizer/) or a transformer
    file / folder (Chroma's, ComfyUI's, diffusers' `transformer/`); `vae`, `t5` name the parts a single file lacks;
    `tokenizer` a T5 tokenizer folder (default: the folder's tokenizer/, else the packaged vocabulary). Headers only;
    ChromaFilesError listing every problem."""
    from ..training.model_files import describe_keys
    path = os.fspath(path)
    root = path if os.path.isdir(path) and os.path.isdir(os.path.join(path, "transformer")) else None
    given = {"transformer": os.path.join(root, "transformer") if root else path, "vae": vae, "t5": t5}
    problems, found, widths = [], {}, {}
    for part, where in given.items():
        kind, words, option = _WANT[part]
        if where is None:
            sub = os.path.join(root, SUBFOLDERS[part]) if root else None
            if sub is None or not os.path.isdir(sub):
                problems.append(f"{part}: missing -- " + (f"{root} has no {SUBFOLDERS[part]}/ folder; " if root else
                                f"{path} is a single transformer file; ") + f"pass {option} ({words})")
                continue
            where = sub
        try:
            files = part_files(where, part)
            shapes = read_headers(files)
        except ChromaFilesError as e:
            problems.append(f"{part} ({option}): {e}")
            continue
        got, got_words, example = describe_keys(shapes)
        if got != kind:
            what = got_words + (f" (keys such as {example})" if example else " (no tensors)")
            problems.append(f"{part} ({option}): {_files.shown(where, files)} is not {words}: it looks like {what}")
            continue
        found[part] = os.fspath(where)
        widths[part] = (_files.shown(where, files), _width(part, shapes))
    if "transformer" not in found:
        problems = [p for p in problems if ": missing -- " not in p]
    params = None
    if "transformer" in found:
        try:
            params = read_chroma_params(found["transformer"])
        except (ChromaCheckpointError, KeyError, ValueError, OSError) as e:
            problems.append(f"transformer (--model): {found['transformer']}: {str(e).splitlines()[0]}")
    if params is not None:
        for part, want, what, name in (("t5", params.context_in_dim, "T5 width (d_model)", "context_in_dim"),
                                       ("vae", params.in_channels // 4, "VAE latent channels", "in_channels / 4")):
            if part in widths and widths[part][1] is not None and widths[part][1] != want:
                problems.append(f"{part} ({_WANT[part][2]}): {widths[part][0]} has {what} {widths[part][1]}, but the "
                                f"transformer {found['transformer']} expects {want} ({name})")
    tok = _files.tokenizer_folder(tokenizer if tokenizer is not None else root, "t5_tokenizer", "unigram",
                                  tokenizer is not None, problems, subfolder=SUBFOLDERS["t5_tokenizer"])
    if len(problems) == 1:
        raise ChromaFilesError(f"the Chroma model {path}: {problems[0]}")
    if problems:
        raise ChromaFilesError(f"the Chroma model {path} is incomplete or mixes parts ({len(problems)} problems):\n  "
                               + "\n  ".join(problems))
    return ChromaFiles(found["transformer"], found["vae"], found["t5"], tok, params)
