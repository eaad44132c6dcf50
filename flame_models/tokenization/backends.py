"""The two engines under CLIPTokenizer and T5Tokenizer: a `tokenizers.Tokenizer`, or a SentencePiece model for
folders that only have `spiece.model`. Both turn captions into content ids (no BOS/EOS/padding: the tokenizer
classes apply those rules) and both split registered special tokens out of the raw text first, as transformers does.
"""
import re

from tokenizers import AddedToken, decoders


def import_sentencepiece(what):
    """The sentencepiece module, needed only for `spiece.model` files and tiny T5 training."""
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(f"{what} needs the sentencepiece package (pip install sentencepiece)") from None
    return sentencepiece


class TokenizersBackend:
    """A `tokenizers.Tokenizer` (normalizer, pre-tokenizer and model already set) plus special tokens."""

    def __init__(self, tokenizer, special_tokens=()):
        self.tokenizer = tokenizer
        tokenizer.post_processor = None
        tokenizer.no_truncation()
        tokenizer.no_padding()
        # normalized=False: a special token only matches its exact raw text, as in transformers.
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
        self.special_ids = {tokenizer.token_to_id(t) for t in special_tokens}

    def __len__(self):
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts):
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def tokenize(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).tokens

    def token_to_id(self, token):
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, index):
        return self.tokenizer.id_to_token(index)

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class SentencePieceBackend:
    """A SentencePiece model (`spiece.model` bytes) with transformers' T5 additions: `<extra_id_{i}>` sentinels
    appended after the model's pieces in reverse order (`<extra_id_0>` last), and special tokens split out of the
    raw text before SentencePiece sees it."""

    def __init__(self, model_proto, special_tokens=(), extra_ids=0, source="spiece.model"):
        self.model_proto = bytes(model_proto)
        self.sp = import_sentencepiece(source).SentencePieceProcessor(model_proto=self.model_proto)
        n = self.sp.get_piece_size()
        self._added = {f"<extra_id_{i}>": n + extra_ids - 1 - i for i in range(extra_ids)}
        for token in special_tokens:
            if token in self._added:
                continue
            index = self.sp.piece_to_id(token)
            if self.sp.id_to_piece(index) != token:
                raise ValueError(f"special token {token!r} is not a piece of {source}")
            self._added[token] = index
        self._by_id = {i: t for t, i in self._added.items()}
        self.special_ids = set(self._by_id)
        self._size = n + extra_ids
        # Longest first, so that `<extra_id_10>` wins over `<extra_id_1>` (leftmost-longest matching).
        alternatives = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        self._decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)

    def __len__(self):
        return self._size

    def _pieces(self, text, as_ids):
        segments = self._split.split(text) if self._split is not None else [text]
        out = []
        for i, segment in enumerate(segments):
            if i % 2 == 1:  # a special token captured by the split
                out.append(self._added[segment] if as_ids else segment)
            elif segment:
                out.extend(self.sp.encode(segment, out_type=int if as_ids else str))
        return out

    def encode_batch(self, texts):
        return [self._pieces(t, True) for t in texts]

    def tokenize(self, text):
        return self._pieces(text, False)

    def token_to_id(self, token):
        if token in self._added:
            return self._added[token]
        index = self.sp.piece_to_id(token)
        return index if self.sp.id_to_piece(index) == token else None

    def id_to_token(self, index):
        if index in self._by_id:
            return self._by_id[index]
        return self.sp.id_to_piece(index) if 0 <= index < self.sp.get_piece_size() else None

    def decode(self, ids, skip_special_tokens=False):
        # transformers decodes T5 through the tokenizers Metaspace decoder (special tokens skipped first),
        # not through SentencePiece's own decode (which would render <unk> as " ⁇ ").
        pieces = [self.id_to_token(int(i)) for i in ids
                  if not (skip_special_tokens and int(i) in self.special_ids)]
        return self._decoder.decode(pieces)
