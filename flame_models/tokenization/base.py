"""The caption -> ids rules shared by CLIPTokenizer and T5Tokenizer: special tokens around the content,
right-side truncation that keeps them, padding to a fixed length, int64 arrays, and checked inputs."""
import numpy as np

from .batch_encoding import BatchEncoding


def _padding_mode(padding):
    """'max_length', 'longest' or None (no padding), from transformers' padding argument values."""
    if padding is True or padding == "longest":
        return "longest"
    if padding is False or padding == "do_not_pad":
        return None
    if padding == "max_length":
        return "max_length"
    raise ValueError(f"padding must be 'max_length', 'longest', True, False or 'do_not_pad', not {padding!r}")


def _as_batch(text):
    """(list of captions, whether a single string was given); every caption checked to be a valid str."""
    single = isinstance(text, str)
    texts = [text] if single else text
    if not isinstance(texts, (list, tuple)):
        raise TypeError(f"captions must be a str or a list/tuple of str, not {type(text).__name__}")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"caption {i} is a {type(t).__name__}, not a str")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"caption {i} is not valid Unicode ({e.reason} at character {e.start})") from None
    return list(texts), single


class TextTokenizer:
    """Base of the tokenizers here: a backend that turns text into content ids, and the model's rules.

    `prefix` / `suffix` token ids surround every caption (CLIP: BOS ... EOS; T5: ... EOS); captions longer than
    `max_length` lose content tokens from the right so that the suffix stays last; padding uses `pad_token_id`.
    """

    label = "text"

    def __init__(self, backend, *, bos_token, eos_token, pad_token, unk_token, model_max_length, source):
        self.backend = backend
        self.source = str(source)
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        ids = {}
        for role, token in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
                            ("unk_token", unk_token)):
            if token is None:
                ids[role] = None
                continue
            index = backend.token_to_id(token)
            if index is None:
                raise ValueError(f"{self.label} tokenizer from {self.source}: {role} {token!r} is not in its "
                                 "vocabulary")
            ids[role] = index
        self.bos_token_id, self.eos_token_id = ids["bos_token"], ids["eos_token"]
        self.pad_token_id, self.unk_token_id = ids["pad_token"], ids["unk_token"]
        if self.eos_token_id is None or self.pad_token_id is None:
            raise ValueError(f"{self.label} tokenizer from {self.source} needs an eos_token and a pad_token")
        self._prefix = [] if self.bos_token_id is None else [self.bos_token_id]
        self._suffix = [self.eos_token_id]
        self.model_max_length = self._check_max_length(model_max_length)

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def num_special_tokens_to_add(self):
        return len(self._prefix) + len(self._suffix)

    @property
    def vocab_size(self):
        """The number of token ids (special and sentinel tokens included): every id is < vocab_size."""
        return len(self.backend)

    def __len__(self):
        return self.vocab_size

    @property
    def all_special_ids(self):
        return sorted(self.backend.special_ids)

    def __repr__(self):
        return (f"{type(self).__name__}(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"model_max_length={self.model_max_length}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"pad={self.pad_token!r} ({self.pad_token_id}))")

    def _check_max_length(self, max_length):
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
            raise TypeError(f"max_length must be an int, not {type(max_length).__name__}")
        if max_length < self.num_special_tokens_to_add:
            raise ValueError(f"max_length={max_length} leaves no room for the {self.num_special_tokens_to_add} "
                             f"special token(s) of a {self.label} caption")
        return int(max_length)

    # ----------------------------------------------------------------------------------------------- encoding
    def _with_specials(self, content, max_length, truncation, index):
        room = max_length - self.num_special_tokens_to_add
        if len(content) > room:
            if not truncation:
                raise ValueError(f"caption {index} needs {len(content) + self.num_special_tokens_to_add} tokens, "
                                 f"more than max_length={max_length}; pass truncation=True to cut it")
            content = content[:room]
        return self._prefix + content + self._suffix

    def __call__(self, text, *, max_length=None, padding="max_length", truncation=True, return_attention_mask=True,
                 return_tensors="np"):
        """Token ids of one caption or a list of captions, as transformers' tokenizer call returns them.

        Defaults are those of the diffusion pipelines: every caption padded (`padding="max_length"`) and truncated
        to `max_length` (default `model_max_length`), `input_ids` an int64 array of shape (B, max_length);
        `attention_mask` (1 on tokens, 0 on padding) unless `return_attention_mask=False`. `padding="longest"`
        pads to the batch's longest caption, `padding=False` not at all (then `return_tensors=None` gives lists).
        A single str gives B = 1.
        """
        texts, _ = _as_batch(text)
        max_length = self.model_max_length if max_length is None else self._check_max_length(max_length)
        mode = _padding_mode(padding)
        if not isinstance(truncation, bool):
            raise TypeError(f"truncation must be True or False, not {truncation!r}")
        if return_tensors not in ("np", None):
            raise ValueError(f"return_tensors must be 'np' or None, not {return_tensors!r}")
        rows = [self._with_specials(c, max_length, truncation, i)
                for i, c in enumerate(self.backend.encode_batch(texts))]
        lengths = [len(r) for r in rows]
        width = max_length if mode == "max_length" else max(lengths, default=0) if mode == "longest" else None
        if width is not None:
            rows = [r + [self.pad_token_id] * (width - len(r)) for r in rows]
        masks = [[1] * n + [0] * (len(r) - n) for r, n in zip(rows, lengths)]
        if return_tensors == "np":
            if width is None and len(set(lengths)) > 1:
                raise ValueError("padding=False gives captions of different lengths "
                                 f"({min(lengths)} to {max(lengths)} tokens): use return_tensors=None or pad them")
            n = width if width is not None else (lengths[0] if lengths else 0)
            rows = np.array(rows, dtype=np.int64).reshape(len(texts), n)
            masks = np.array(masks, dtype=np.int64).reshape(len(texts), n)
        out = BatchEncoding(input_ids=rows)
        if return_attention_mask:
            out["attention_mask"] = masks
        return out

    def encode(self, text, *, max_length=None, truncation=False):
        """One caption's ids with its special tokens, unpadded; truncated to `max_length` (default
        `model_max_length`) only when `truncation=True`, so `len(encode(c)) > model_max_length` tells a caption
        that would be cut."""
        texts, single = _as_batch(text)
        if not single:
            raise TypeError("encode takes one caption (a str); call the tokenizer for a list")
        if truncation:
            max_length = self.model_max_length if max_length is None else self._check_max_length(max_length)
        elif max_length is not None:
            raise ValueError("encode's max_length applies only with truncation=True")
        content = self.backend.encode_batch(texts)[0]
        if truncation:
            return self._with_specials(content, max_length, True, 0)
        return self._prefix + content + self._suffix

    def tokenize(self, text):
        """The token strings of a caption's content (no special tokens added)."""
        texts, single = _as_batch(text)
        if not single:
            raise TypeError("tokenize takes one caption (a str)")
        return self.backend.tokenize(texts[0])

    # ----------------------------------------------------------------------------------------------- decoding
    def _check_ids(self, ids):
        ids = np.asarray(ids)
        if ids.ndim == 1 and ids.size == 0:
            return []
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be a 1-D sequence of ints, got shape {ids.shape} dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside this tokenizer's vocabulary [0, {self.vocab_size})")
        return [int(i) for i in ids]

    def decode(self, token_ids, skip_special_tokens=False):
        return self.backend.decode(self._check_ids(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens=False):
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, (int, np.integer)):
            return self.backend.id_to_token(int(ids))
        return [self.backend.id_to_token(int(i)) for i in ids]
