"""Textual-inversion embeddings for SDXL's CLIPs (A1111 / kohya / civitai SDXL embedding files, diffusers'
`load_textual_inversion` for SDXL): a .safetensors file with `clip_l` (n, 768) and `clip_g` (n, 1280) -- n vectors
each CLIP reads in place of the embedding's word. A prompt names an embedding by its token (the file's name without
the extension, or the one given: `--embedding path:token`) as a word -- bare, as A1111 and diffusers read it, or as
ComfyUI's `embedding:token`; commas right after it are kept as text. Its vectors are appended to each CLIP's token
table (text_encoders.clip: add_token_vectors) and the word's ids are theirs.

Files from others are untrusted: only safetensors (no pickles) is read; the header is checked first -- the two keys,
2-D shapes of at most MAX_VECTORS rows, widths the encoders' -- and the values must be finite.
"""
import os
import re

import numpy as np

from flame_core import io

KEYS = ("clip_l", "clip_g")
MAX_VECTORS = 75          # one CLIP window of content tokens
_TOKEN = re.compile(r"^[\w.\-]+$")


class EmbeddingError(ValueError):
    """A textual-inversion file or token that cannot be used (the message names the file and what is wrong)."""


class TextualInversion:
    """One embedding: `token` and `vectors` {"clip_l": (n, 768), "clip_g": (n, 1280)} float32, from `path`."""

    def __init__(self, token, vectors, path=None):
        self.token, self.vectors, self.path = token, vectors, path

    def __repr__(self):
        return f"TextualInversion({self.token!r}, {self.vectors['clip_l'].shape[0]} vectors, from {self.path!r})"


def parse_spec(spec):
    """"path" or "path:token" (the token defaults to the file's name without its extension) -> (path, token)."""
    path, token = str(spec), None
    head, sep, tail = path.rpartition(":")
    if sep and head and not os.path.exists(path) and _TOKEN.match(tail):
        path, token = head, tail
    if token is None:
        token = os.path.splitext(os.path.basename(path))[0]
    if not _TOKEN.match(token):
        raise EmbeddingError(f"embedding {spec!r}: its token {token!r} must be one word of letters, digits, "
                             f"'_', '-' or '.' (name it: path:token)")
    return path, token


def load_embedding(spec, widths=None):
    """A TextualInversion from "path[:token]" (parse_spec). widths: {"clip_l": 768, "clip_g": 1280} the encoders'
    hidden sizes, checked from the header before anything is read."""
    path, token = parse_spec(spec)
    if not os.path.isfile(path):
        raise EmbeddingError(f"embedding {path}: not a file")
    if not path.lower().endswith(".safetensors"):
        raise EmbeddingError(f"embedding {path}: only .safetensors files are read (a .pt / .bin pickle can run code "
                             f"when loaded; convert it to safetensors first)")
    try:
        with io.safe_open(path, framework="numpy") as f:
            keys = set(f.keys())
            missing = [k for k in KEYS if k not in keys]
            if missing:
                raise EmbeddingError(f"embedding {path}: no {' / '.join(missing)} tensor (an SDXL embedding holds "
                                     f"clip_l and clip_g; it has {sorted(keys)[:6]})")
            shapes = {k: tuple(f.shape(k)) for k in KEYS}
            for k, s in shapes.items():
                want = None if widths is None else widths[k]
                if len(s) != 2 or not 1 <= s[0] <= MAX_VECTORS or (want is not None and s[1] != want):
                    raise EmbeddingError(f"embedding {path}: {k} has shape {s}; (n, {want or 'width'}) with 1 <= n "
                                         f"<= {MAX_VECTORS} for this model")
            if shapes["clip_l"][0] != shapes["clip_g"][0]:
                raise EmbeddingError(f"embedding {path}: clip_l has {shapes['clip_l'][0]} vectors, clip_g "
                                     f"{shapes['clip_g'][0]}")
            vectors = {k: np.asarray(f.get_tensor(k), dtype=np.float32) for k in KEYS}
    except (io.SafetensorsError, OSError) as e:
        raise EmbeddingError(f"embedding {path}: cannot read it ({e})") from None
    for k, v in vectors.items():
        if not np.isfinite(v).all():
            raise EmbeddingError(f"embedding {path}: {k} holds values that are not finite")
    return TextualInversion(token, vectors, path)


def word_ids(word, table):
    """(ids, leftover) of a prompt word naming an embedding of `table` ({token: ids}): the word itself, or
    ComfyUI's "embedding:token", with commas after it left over as text; None when it names none."""
    name = word[len("embedding:"):] if word.startswith("embedding:") else word
    stripped = name.rstrip(",")
    if stripped in table:
        return table[stripped], name[len(stripped):]
    return None
