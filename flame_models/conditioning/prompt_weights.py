"""Prompt weights in ComfyUI's syntax (its CLIPTextEncode: comfy/sd1_clip.py), for the CLIP encoders:

    (text)        text's weight times 1.1 (nested: 1.21, ...)
    (text:1.3)    text's weight set to 1.3 (the number after the last colon; the parentheses hold the rest)
    \\( and \\)     literal parentheses
    anything else weight 1

Each weighted piece is tokenised on its own, word by word (ComfyUI's split on spaces: for CLIP's BPE, whose
pre-tokeniser splits on whitespace, the ids of the whole piece), the ids laid out as the plain prompt's would be --
BOS, content, EOS, padding; truncated at 77, or in kohya's 75-token chunks with max_token_length -- and every
special or padding position has weight 1. The encoder's states z of a token of weight w become

    z_w = (z - z_empty) · w + z_empty

z_empty being the states of the empty prompt at the same position (ComfyUI's default weight interpretation); the
pooled vector stays the plain prompt's. Without weights (every one 1) the ids and states are the plain prompt's.
Opt-in (`prompt_weights=True`; generate --prompt-weights): diffusers, and FLAME without it, read parentheses as text.
Not taken from ComfyUI: its `embedding:` words (read as text here) and its own way of cutting prompts longer than 77
tokens (here diffusers' truncation, or kohya's chunks).
"""
import math
import re

import numpy as np

import flame_core as flame

from .embeddings import word_ids
from .encoders import CHUNK, chunk_rows, clip_states

_OPEN, _CLOSE = "\0\2", "\0\1"   # escaped parentheses while parsing
# "(text:number)": what a prompt written for ComfyUI / A1111 holds (generate's hint when weights are off)
WEIGHT_PATTERN = re.compile(r"\([^()]*:\s*[-+]?(\d+\.?\d*|\.\d+)\s*\)")


def _groups(text):
    """The top level of `text`: plain runs and "(...)" groups, ComfyUI's rules for unbalanced parentheses (a ")"
    with nothing open, and what follows it until the depth is back at 0, is plain text)."""
    out, cur, depth = [], "", 0
    for ch in text:
        if ch == "(":
            if depth == 0:
                if cur:
                    out.append(cur)
                cur = "("
            else:
                cur += ch
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                out.append(cur + ")")
                cur = ""
            else:
                cur += ch
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def _weights(text, weight):
    out = []
    for g in _groups(text):
        if len(g) < 2 or g[0] != "(" or g[-1] != ")":
            out.append((g, weight))
            continue
        inner, w = g[1:-1], weight * 1.1
        colon = inner.rfind(":")
        if colon > 0:
            try:
                w = float(inner[colon + 1:])
                inner = inner[:colon]
            except ValueError:
                pass
        out.extend(_weights(inner, w))
    return out


def parse(text):
    """[(piece, weight)] of a prompt (the module docstring's syntax); a ValueError naming a weight that is not a
    finite number."""
    escaped = text.replace("\\)", _CLOSE).replace("\\(", _OPEN)
    out = []
    for piece, w in _weights(escaped, 1.0):
        if not math.isfinite(w):
            raise ValueError(f"prompt weight {w} of {piece!r}: not a finite number")
        out.append((piece.replace(_CLOSE, ")").replace(_OPEN, "("), w))
    return out


def is_weighted(text):
    """Whether any piece of the prompt has a weight other than 1."""
    return any(w != 1.0 for _, w in parse(text))


def weighted_ids(tokenizer, prompts, max_token_length=None, *, length=None, parse_weights=True, embeddings=None):
    """(ids (B * n, 77) int64, weights (B * n, 77) float32) of `prompts` for one CLIP tokenizer, laid out as
    encoders.clip_ids lays out the plain prompts (n = max_token_length / 75 chunks, or 1); length: a T5 tokenizer's
    (B, length) layout instead -- content, EOS, padding, as the pipelines pad and truncate T5's ids. parse_weights=
    False: the prompts are plain text (every weight 1; the same ids as the plain tokenizer's). embeddings: {token:
    ids} of textual inversions (conditioning/embeddings.py: a word naming one becomes its ids)."""
    if length is not None:
        total = int(length)
    else:
        total = tokenizer.model_max_length if max_token_length in (None, CHUNK) else max_token_length + 2
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    head = [] if bos is None else [bos]
    rows, wrows = [], []
    for p in prompts:
        ids, ws = [], []
        for piece, w in (parse(p) if parse_weights else [(p, 1.0)]):
            for word in piece.replace("\n", " ").split(" "):
                named = word_ids(word, embeddings) if embeddings and word else None
                if named is not None:
                    ids += named[0]
                    ws += [w] * len(named[0])
                    word = named[1]
                if word:
                    t = tokenizer.backend.encode_batch([word])[0]
                    ids += t
                    ws += [w] * len(t)
        room = total - len(head) - 1
        ids, ws = ids[:room], ws[:room]
        fill = room - len(ids)
        rows.append(head + ids + [eos] + [pad] * fill)
        wrows.append([1.0] * len(head) + ws + [1.0] + [1.0] * fill)
    ids, weights = np.array(rows, np.int64), np.array(wrows, np.float32)
    if length is not None or total == tokenizer.model_max_length:
        return ids, weights
    return chunk_rows(tokenizer, ids, max_token_length), chunk_rows(None, weights, max_token_length)


def join_chunks(weights, batch):
    """(B, 75 n + 2) weights of `batch` captions from weighted_ids' (B * n, 77) rows, joined as encoders.clip_states
    joins the chunks' states."""
    n = weights.shape[0] // batch
    if n == 1:
        return weights
    w = weights.reshape(batch, n, -1)
    return np.concatenate([w[:, 0, :1]] + [w[:, k, 1:-1] for k in range(n)] + [w[:, -1, -1:]], axis=1)


def apply(hidden, empty, weights):
    """(hidden - empty) · w + empty, per token: hidden (B, L, C), empty (1, L, C) (the empty prompt's states),
    weights (B, L) -- computed in float32 (float64 for a float64 model), returned in hidden's dtype; positions of
    weight 1 keep hidden's value."""
    w = flame.tensor(np.asarray(weights, np.float32)[..., None], device=hidden.device)
    wide = flame.float64 if hidden.dtype == flame.float64 else flame.float32
    h, e = hidden.to(wide), empty.to(wide)
    out = flame.where(w == 1.0, h, (h - e) * w + e)
    return out.to(hidden.dtype)


def apply_clip(run, model, hidden, empty_ids, weights, batch):
    """A CLIP's states `hidden` (B, L, C; encoders.clip_states of `batch` captions) with per-token `weights` (the
    (B * n, 77) rows of weighted_ids) applied against the states of the empty prompt's ids `empty_ids` (the bundle's
    tokenize([""]) of the same layout), run by `run` (the bundle's graphed encoder or the model)."""
    empty, _ = clip_states(run, model, empty_ids, 1)
    return apply(hidden, empty, join_chunks(weights, batch))
