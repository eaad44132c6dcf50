"""T5Tokenizer: T5 v1.1's SentencePiece Unigram vocabulary; `</s>` (1) appended, padding with `<pad>` (0),
512 tokens for Flux-dev, 256 for schnell (`max_length`).

From `tokenizer.json` the pipeline is the one transformers' T5Tokenizer (T5TokenizerFast) builds from it: the
file's Unigram pieces and scores, its SentencePiece `Precompiled` normaliser (nmt_nfkc), whitespace splitting (so
runs of spaces, tabs and newlines count as one space, as in SentencePiece) and the `▁` word-start marker. From a
folder with only `spiece.model`, SentencePiece itself encodes. Either way `<pad>`, `</s>`, `<unk>` and the
`<extra_id_N>` sentinels are special tokens split out of the raw text first, and truncation keeps `</s>` last.
"""
import base64
import io
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import Unigram

from flame_core.io import atomic_write, write_json

from .backends import SentencePieceBackend, TokenizersBackend, import_sentencepiece
from .base import TextTokenizer
from .files import find_tokenizer_folder, first_given, read_json, read_tokenizer_config
from .packaged import T5_TOKENIZER_JSON, read_packaged

EOS, PAD, UNK = "</s>", "<pad>", "<unk>"
MAX_LENGTH = 512
EXTRA_IDS = 100
SUBFOLDERS = ("tokenizer_2", "tokenizer_3", "tokenizer")  # Flux: tokenizer_2; SD3: tokenizer_3


def _precompiled_charsmap(normalizer):
    """The SentencePiece charsmap of a tokenizer.json normalizer (alone or inside a Sequence), or None."""
    if not isinstance(normalizer, dict):
        return None
    if normalizer.get("type") == "Sequence":
        found = (_precompiled_charsmap(n) for n in normalizer.get("normalizers", []))
        return next((c for c in found if c is not None), None)
    if normalizer.get("type") == "Precompiled" and normalizer.get("precompiled_charsmap"):
        return base64.b64decode(normalizer["precompiled_charsmap"])
    return None


def unigram_pipeline(pieces, unk_id, charsmap=None, byte_fallback=False):
    """A tokenizers.Tokenizer set up as transformers' T5Tokenizer sets up its backend."""
    tokenizer = Tokenizer(Unigram(pieces, unk_id=unk_id, byte_fallback=byte_fallback))
    if charsmap is not None:
        tokenizer.normalizer = normalizers.Precompiled(charsmap)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return tokenizer


def _tokenizers_backend(data, source, special_tokens, extra_ids):
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "Unigram":
        kind = model.get("type") if isinstance(model, dict) else None
        raise ValueError(f"{source}: T5 needs a Unigram (SentencePiece) tokenizer.json, this one is {kind!r}")
    pieces = [(str(p), float(s)) for p, s in model["vocab"]]
    unk_id = model.get("unk_id")
    if unk_id is None:
        raise ValueError(f"{source}: the Unigram model has no unk_id")
    try:
        pipeline = unigram_pipeline(pieces, unk_id, _precompiled_charsmap(data.get("normalizer")),
                                    bool(model.get("byte_fallback", False)))
    except Exception as e:  # tokenizers raises a bare Exception for an inconsistent model
        raise ValueError(f"{source}: {e}") from None
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids)]
    return TokenizersBackend(pipeline, list(dict.fromkeys([*special_tokens, *sentinels])))


class T5Tokenizer(TextTokenizer):
    """T5 tokenizer: `tok(captions)` -> BatchEncoding with `input_ids` int64 (B, max_length): content, `</s>`, pad."""

    label = "T5"

    def __init__(self, backend, *, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=MAX_LENGTH,
                 source="vocab"):
        super().__init__(backend, bos_token=None, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
                         model_max_length=model_max_length, source=source)

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_tokenizer_json(cls, data, *, extra_ids=EXTRA_IDS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                            model_max_length=MAX_LENGTH, source="tokenizer.json"):
        """From a parsed tokenizer.json (a dict) of a Unigram model."""
        backend = _tokenizers_backend(data, source, [pad_token, eos_token, unk_token], extra_ids)
        return cls(backend, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
                   model_max_length=model_max_length, source=source)

    @classmethod
    def from_spiece(cls, model_proto, *, extra_ids=EXTRA_IDS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                    model_max_length=MAX_LENGTH, source="spiece.model"):
        """From the bytes of a SentencePiece model (`spiece.model`)."""
        try:
            backend = SentencePieceBackend(model_proto, [pad_token, eos_token, unk_token], extra_ids, source)
        except RuntimeError as e:  # sentencepiece's message for a file that is not a model
            raise ValueError(f"{source} is not a SentencePiece model: {e}") from None
        return cls(backend, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
                   model_max_length=model_max_length, source=source)

    @classmethod
    def from_pretrained(cls, path, subfolder=None, *, max_length=None, pad_token=None):
        """The T5 tokenizer of a model folder (Flux `tokenizer_2/`, SD3 `tokenizer_3/`) or a tokenizer folder:
        `tokenizer.json` when present, else `spiece.model` through SentencePiece. `max_length` (e.g. 256 for Flux
        schnell) and `pad_token` override the folder's config."""
        folder = find_tokenizer_folder(path, want="unigram", label="T5", subfolder=subfolder, subfolders=SUBFOLDERS)
        config = read_tokenizer_config(folder)
        tokens = config.special_tokens
        kwargs = dict(extra_ids=first_given(config.extra_ids, EXTRA_IDS), eos_token=tokens.get("eos_token", EOS),
                      pad_token=first_given(pad_token, tokens.get("pad_token"), PAD),
                      unk_token=tokens.get("unk_token", UNK),
                      model_max_length=first_given(max_length, config.model_max_length, MAX_LENGTH))
        if (folder / "tokenizer.json").is_file():
            source = folder / "tokenizer.json"
            return cls.from_tokenizer_json(read_json(source), source=str(source), **kwargs)
        source = folder / "spiece.model"
        return cls.from_spiece(source.read_bytes(), source=str(source), **kwargs)

    @classmethod
    def from_package(cls, *, max_length=None, pad_token=None):
        """T5 v1.1's vocabulary shipped with FLAME (the one Flux and SD3 use)."""
        data = json.loads(read_packaged(T5_TOKENIZER_JSON, "the model folder's tokenizer_2/ (Flux) or "
                                                           "tokenizer_3/ (SD3), or a google/t5-v1_1 tokenizer folder"))
        return cls.from_tokenizer_json(data, pad_token=first_given(pad_token, PAD),
                                       model_max_length=first_given(max_length, MAX_LENGTH),
                                       source=f"packaged:{T5_TOKENIZER_JSON}")

    @classmethod
    def train_tiny(cls, corpus, vocab_size=256, *, model_max_length=MAX_LENGTH):
        """A small T5-style tokenizer learned from `corpus` (a list of captions) by SentencePiece's Unigram trainer
        (deterministic, milliseconds): `<pad>`=0, `</s>`=1, `<unk>`=2, nmt_nfkc normalisation, at most
        `vocab_size` pieces (fewer when the corpus is small), no sentinels."""
        if isinstance(corpus, str) or not corpus or not all(isinstance(t, str) for t in corpus):
            raise TypeError("corpus must be a non-empty list of str")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 8:
            raise ValueError(f"vocab_size must be an int >= 8, got {vocab_size!r}")
        sentencepiece = import_sentencepiece("T5Tokenizer.train_tiny")
        model = io.BytesIO()
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, model_type="unigram",
                pad_id=0, eos_id=1, unk_id=2, bos_id=-1, normalization_rule_name="nmt_nfkc",
                character_coverage=1.0, hard_vocab_limit=False, num_threads=1, minloglevel=2)
        except RuntimeError as e:
            raise ValueError(f"T5Tokenizer.train_tiny: SentencePiece could not train on this corpus: {e}") from None
        return cls.from_spiece(model.getvalue(), extra_ids=0, model_max_length=model_max_length, source="train_tiny")

    def save_pretrained(self, folder):
        """Write spiece.model (SentencePiece backend) or tokenizer.json, and tokenizer_config.json, atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if isinstance(self.backend, SentencePieceBackend):
            with atomic_write(folder / "spiece.model") as f:
                f.write(self.backend.model_proto)
            extra_ids = len(self.backend) - self.backend.sp.get_piece_size()
        else:
            with atomic_write(folder / "tokenizer.json") as f:
                f.write(self.backend.tokenizer.to_str().encode("utf-8"))
            extra_ids = sum(1 for i in self.backend.special_ids
                            if (self.backend.id_to_token(i) or "").startswith("<extra_id_"))
        config = {"tokenizer_class": "T5Tokenizer", "eos_token": self.eos_token, "pad_token": self.pad_token,
                  "unk_token": self.unk_token, "extra_ids": extra_ids, "model_max_length": self.model_max_length}
        write_json(folder / "tokenizer_config.json", config)
        return folder
