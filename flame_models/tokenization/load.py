"""load_tokenizer: one entry point for the tokenizers of the diffusion models' text encoders."""
from .clip import CLIPTokenizer
from .t5 import T5Tokenizer

KINDS = ("clip_l", "clip_g", "t5")


def load_tokenizer(kind, path=None, *, max_length=None, subfolder=None, pad_token=None):
    """The tokenizer of text encoder `kind` ('clip_l', 'clip_g' or 't5').

    `path`: a diffusers model folder (CLIP-L from `tokenizer/`, CLIP-G from `tokenizer_2/`, T5 from `tokenizer_2/`
    or `tokenizer_3/`), a tokenizer folder, or None for the vocabulary packaged with FLAME (for single-file
    checkpoints). `max_length`: 77 for CLIP; T5 512 (Flux-dev) or 256 (Flux-schnell); default the folder's config.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if path is None:
        if subfolder is not None:
            raise ValueError("subfolder needs a path")
        if kind == "t5":
            return T5Tokenizer.from_package(max_length=max_length, pad_token=pad_token)
        return CLIPTokenizer.from_package(kind, max_length=max_length, pad_token=pad_token)
    if kind == "t5":
        return T5Tokenizer.from_pretrained(path, subfolder, max_length=max_length, pad_token=pad_token)
    return CLIPTokenizer.from_pretrained(path, subfolder, kind=kind, max_length=max_length, pad_token=pad_token)
