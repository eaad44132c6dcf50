"""Qwen2Tokenizer (Qwen2 / Qwen2.5 / Qwen2.5-VL, Qwen-Image's `tokenizer/`): byte-level BPE built as transformers'
Qwen2 converter builds it -- NFC, split by Qwen2's pattern (isolated), byte-level characters, BPE without an unknown
token -- from the folder's tokenizer.json when it has one, else from vocab.json + merges.txt, with the special tokens
of tokenizer_config.json's added_tokens_decoder (or added_tokens.json) matched whole in the raw text. No BOS / EOS are
added; padding is on the right with the pad token (`<|endoftext|>` unless the config names another).

    tok = Qwen2Tokenizer.from_folder("Qwen-Image/tokenizer")
    ids, mask = tok(["<|im_start|>user\\na cat<|im_end|>"], max_length=1058)     # (B, L) int64, right-padded
"""
import json
import os

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .errors import TokenizerFilesError

PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
           r"""\s+(?!\S)|\s+""")
DEFAULT_PAD = "<|endoftext|>"


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerFilesError(f"{path}: cannot read it as JSON ({e})") from None


def _merges(path):
    with open(path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f]
    pairs = []
    for i, ln in enumerate(lines):
        if not ln or (i == 0 and ln.startswith("#version")):
            continue
        parts = ln.split(" ")
        if len(parts) != 2:
            raise TokenizerFilesError(f"{path}, line {i + 1}: a merge is two tokens separated by one space, got "
                                      f"{ln!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


def _content(v):
    return v.get("content") if isinstance(v, dict) else v


class Qwen2Tokenizer:
    def __init__(self, tokenizer, special_tokens, pad_token=DEFAULT_PAD):
        self.tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.no_truncation()
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
        self.pad_token = pad_token
        self.pad_token_id = tokenizer.token_to_id(pad_token)
        if self.pad_token_id is None:
            raise TokenizerFilesError(f"the pad token {pad_token!r} is not in the vocabulary")

    @classmethod
    def from_folder(cls, folder):
        """From a tokenizer folder (a pipeline's `tokenizer/` too)."""
        folder = os.fspath(folder)
        if os.path.isdir(os.path.join(folder, "tokenizer")) and not os.path.exists(os.path.join(folder,
                                                                                                "vocab.json")):
            folder = os.path.join(folder, "tokenizer")
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        specials = {int(k): _content(v) for k, v in (config.get("added_tokens_decoder") or {}).items()}
        added_path = os.path.join(folder, "added_tokens.json")
        if os.path.isfile(added_path):
            specials.update({int(i): t for t, i in _read_json(added_path).items()})
        pad = _content(config.get("pad_token")) or DEFAULT_PAD
        tj = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(tj):
            return cls(Tokenizer.from_file(tj), [t for _, t in sorted(specials.items())], pad)
        vocab_path, merges_path = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
        missing = [p for p in (vocab_path, merges_path) if not os.path.isfile(p)]
        if missing:
            raise TokenizerFilesError(f"{folder}: not a Qwen2 tokenizer folder (no tokenizer.json, and no "
                                      f"{', '.join(os.path.basename(p) for p in missing)})")
        vocab = _read_json(vocab_path)
        for i, t in specials.items():
            if t in vocab and vocab[t] != i:
                raise TokenizerFilesError(f"{folder}: special token {t!r} has id {i} in the config but "
                                          f"{vocab[t]} in vocab.json")
        tok = Tokenizer(BPE(vocab=vocab, merges=_merges(merges_path), dropout=None, unk_token=None,
                            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                            byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        # the special tokens at their config ids: added in id order after the vocabulary, as transformers does
        for i, t in sorted(specials.items()):
            if t not in vocab:
                got = tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
                if got and tok.token_to_id(t) != i:
                    raise TokenizerFilesError(f"{folder}: special token {t!r} would get id {tok.token_to_id(t)}, "
                                              f"its config says {i} (ids between the vocabulary and it are missing)")
        return cls(tok, [t for _, t in sorted(specials.items())], pad)

    def __len__(self):
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def __call__(self, texts, max_length=None):
        """(input_ids, attention_mask) (B, L) int64 for `texts`, each cut to max_length tokens (truncation on the
        right), right-padded with the pad token to the longest."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        ids = [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        if max_length is not None:
            ids = [i[:max_length] for i in ids]
        n = max(len(i) for i in ids)
        out = np.full((len(ids), n), self.pad_token_id, np.int64)
        mask = np.zeros((len(ids), n), np.int64)
        for b, i in enumerate(ids):
            out[b, :len(i)], mask[b, :len(i)] = i, 1
        return out, mask
