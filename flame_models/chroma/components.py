"""Finding the parts of a Chroma model: the transformer, the Flux VAE, T5-XXL and its tokenizer.

    files = find_chroma_files("Chroma1-HD/")                                  # a diffusers ChromaPipeline folder
    files = find_chroma_files("chroma-unlocked-v50.safetensors", vae="ae.safetensors",
                              t5="t5xxl_fp16.safetensors")                     # Chroma / ComfyUI single files

Only headers are read: every part is checked to be what it should be and to fit the transformer (T5 width =
context_in_dim, VAE latent channels x 4 = in_channels), and ONE error lists every problem."""
import os
from dataclasses import dataclass

from ..bfl.components import fit_problems, locate_separate_parts
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


def find_chroma_files(path, *, vae=None, t5=None, tokenizer=None):
    """ChromaFiles: `path` a diffusers Chroma folder (transformer/, vae/, text_encoder/, tokenizer/) or a transformer
    file / folder (Chroma's, ComfyUI's, diffusers' `transformer/`); `vae`, `t5` name the parts a single file lacks;
    `tokenizer` a T5 tokenizer folder (default: the folder's tokenizer/, else the packaged vocabulary). Headers only;
    ChromaFilesError listing every problem."""
    root, found, widths, params, problems = locate_separate_parts(
        path, {"vae": vae, "t5": t5}, _WANT, subfolders=SUBFOLDERS, error=ChromaFilesError,
        read_params=read_chroma_params, param_errors=(ChromaCheckpointError, KeyError, ValueError, OSError))
    if params is not None:
        problems += fit_problems({"t5": (params.context_in_dim, "T5 width (d_model)", "context_in_dim"),
                                  "vae": (params.in_channels // 4, "VAE latent channels", "in_channels / 4")},
                                 widths, _WANT, found["transformer"])
    tok = _files.tokenizer_folder(tokenizer if tokenizer is not None else root, "t5_tokenizer", "unigram",
                                  tokenizer is not None, problems, subfolder=SUBFOLDERS["t5_tokenizer"])
    _files.report(problems, "Chroma model", os.fspath(path), ChromaFilesError)
    return ChromaFiles(found["transformer"], found["vae"], found["t5"], tok, params)
