"""CLIPTokenizer: CLIP's byte-level BPE with end-of-word suffix `</w>`, 77 tokens with `<|startoftext|>` (49406)
and `<|endoftext|>` (49407) in the standard vocabulary.

The pipeline is the one transformers' CLIPTokenizer (CLIPTokenizerFast) builds, whatever file the vocabulary comes
from: text NFC-normalised, runs of whitespace made one space, lower-cased (no ftfy, no HTML unescaping: the fast
tokenizer does neither), split by CLIP's word pattern, mapped to byte-level characters, then BPE. The pad token
comes from the folder's config; by kind it is `<|endoftext|>` for CLIP-L and `!` (id 0) for CLIP-G / bigG (SDXL's
`tokenizer_2`, SD3's second CLIP). As in transformers, the pad token is a special token, so a `!` typed in a
caption becomes id 0 under CLIP-G's rules.
"""
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from flame_core.io import atomic_write, write_json

from .backends import TokenizersBackend
from .base import TextTokenizer
from .bpe_training import learn_bpe_merges, pretokenized_words
from .files import find_tokenizer_folder, first_given, read_json, read_tokenizer_config
from .packaged import CLIP_MERGES, read_packaged

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
DEFAULT_PAD = {"clip_l": EOS, "clip_g": "!"}
SUBFOLDERS = {None: ("tokenizer", "tokenizer_2"), "clip_l": ("tokenizer",), "clip_g": ("tokenizer_2",)}
WORD_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
MAX_LENGTH = 77


def byte_alphabet():
    """The 256 characters that stand for the bytes 0..255 in byte-level BPE, in CLIP's (and GPT-2's) order:
    printable Latin-1 bytes stand for themselves, the others for code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def vocab_from_merges(merges):
    """CLIP's vocabulary for a merge list: bytes, bytes + `</w>`, one token per merge, then BOS and EOS."""
    alphabet = byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in merges] + [BOS, EOS]
    vocab = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab


def parse_merges(text, source):
    merges = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{source} line {number}: a merge is two tokens separated by one space, got {line!r}")
        merges.append(tuple(pair))
    return merges


def clip_pipeline(vocab, merges):
    """A tokenizers.Tokenizer set up exactly as transformers' CLIPTokenizer sets up its backend."""
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="</w>", fuse_unk=False, unk_token=EOS))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _check_kind(kind):
    if kind not in SUBFOLDERS:
        raise ValueError(f"kind must be 'clip_l', 'clip_g' or None, not {kind!r}")


class CLIPTokenizer(TextTokenizer):
    """CLIP tokenizer: `tok(captions)` -> BatchEncoding with `input_ids` int64 (B, 77): BOS, content, EOS, pad."""

    label = "CLIP"

    def __init__(self, vocab, merges, *, pad_token=EOS, bos_token=BOS, eos_token=EOS, unk_token=EOS,
                 model_max_length=MAX_LENGTH, source="vocab"):
        self.vocab = dict(vocab)
        self.merges = [tuple(m) for m in merges]
        specials = list(dict.fromkeys(t for t in (bos_token, eos_token, unk_token, pad_token) if t is not None))
        missing = [t for t in specials if t not in self.vocab]
        if missing:
            raise ValueError(f"CLIP tokenizer from {source}: special token(s) {missing} are not in its vocabulary")
        try:
            pipeline = clip_pipeline(self.vocab, self.merges)
        except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
            raise ValueError(f"CLIP tokenizer from {source}: {e}") from None
        backend = TokenizersBackend(pipeline, specials)
        super().__init__(backend, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
                         model_max_length=model_max_length, source=source)

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path, subfolder=None, *, kind=None, max_length=None, pad_token=None):
        """The CLIP tokenizer of a model folder (diffusers `tokenizer/`, `tokenizer_2/`) or a tokenizer folder.

        `kind` ('clip_l' / 'clip_g') picks the subfolder of a model folder (`tokenizer/` / `tokenizer_2/`) and the
        default pad token when the folder's config sets none (`<|endoftext|>` / `!`); without it the first CLIP
        tokenizer found is used with CLIP-L's default. `max_length` and `pad_token` override the folder's config.
        """
        _check_kind(kind)
        folder = find_tokenizer_folder(path, want="bpe", label="CLIP", subfolder=subfolder,
                                       subfolders=SUBFOLDERS[kind])
        if (folder / "tokenizer.json").is_file():
            source = folder / "tokenizer.json"
            model = read_json(source)["model"]
            vocab, merges = model.get("vocab"), model.get("merges")
            if not isinstance(vocab, dict) or not isinstance(merges, list):
                raise ValueError(f"{source}: model.vocab must be an object and model.merges a list")
            merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
            if any(len(m) != 2 for m in merges):
                raise ValueError(f"{source}: every merge must be a pair of tokens")
        else:
            source = folder / "vocab.json"
            vocab = read_json(source)
            if not isinstance(vocab, dict):
                raise ValueError(f"{source} must map tokens to ids")
            merges = parse_merges((folder / "merges.txt").read_text(encoding="utf-8"), folder / "merges.txt")
        config = read_tokenizer_config(folder)
        tokens = config.special_tokens
        return cls(vocab, merges,
                   pad_token=first_given(pad_token, tokens.get("pad_token"), DEFAULT_PAD.get(kind, EOS)),
                   bos_token=tokens.get("bos_token", BOS), eos_token=tokens.get("eos_token", EOS),
                   unk_token=tokens.get("unk_token", EOS),
                   model_max_length=first_given(max_length, config.model_max_length, MAX_LENGTH), source=str(folder))

    @classmethod
    def from_package(cls, kind="clip_l", *, max_length=None, pad_token=None):
        """CLIP's standard vocabulary shipped with FLAME (CLIP-L and CLIP-G share it; `kind` sets the pad rule)."""
        if kind not in DEFAULT_PAD:
            raise ValueError(f"kind must be 'clip_l' or 'clip_g', not {kind!r}")
        needed = {"clip_l": "the model folder's tokenizer/ (CLIP-L)",
                  "clip_g": "the model folder's tokenizer_2/ (CLIP-G)"}[kind]
        merges = _packaged_merges(needed)
        return cls(vocab_from_merges(merges), merges, pad_token=first_given(pad_token, DEFAULT_PAD[kind]),
                   model_max_length=first_given(max_length, MAX_LENGTH), source=f"packaged:{CLIP_MERGES}")

    @classmethod
    def train_tiny(cls, corpus, vocab_size=1024, *, kind="clip_l", pad_token=None, model_max_length=MAX_LENGTH,
                   min_frequency=2):
        """A small CLIP-style tokenizer learned from `corpus` (a list of captions), deterministically, in
        milliseconds: CLIP's normalisation, byte alphabet, `</w>` suffix and layout (bytes, merges, BOS, EOS last,
        so EOS is the largest id as CLIP's pooling expects), with at most `vocab_size` tokens."""
        if kind not in DEFAULT_PAD:
            raise ValueError(f"kind must be 'clip_l' or 'clip_g', not {kind!r}")
        base = 2 * 256 + 2
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < base:
            raise ValueError(f"vocab_size must be an int >= {base} (256 bytes, their </w> forms, BOS, EOS), "
                             f"got {vocab_size!r}")
        pipeline = clip_pipeline(vocab_from_merges([]), [])
        words = pretokenized_words(corpus, pipeline.normalizer, pipeline.pre_tokenizer, suffix="</w>")
        merges = learn_bpe_merges(words, vocab_size - base, min_frequency=min_frequency)
        return cls(vocab_from_merges(merges), merges, pad_token=first_given(pad_token, DEFAULT_PAD[kind]),
                   model_max_length=model_max_length, source="train_tiny")

    def save_pretrained(self, folder):
        """Write vocab.json, merges.txt and tokenizer_config.json (each atomically) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "vocab.json", self.vocab, indent=None, ensure_ascii=False)
        merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in self.merges)
        with atomic_write(folder / "merges.txt") as f:
            f.write(merges.encode("utf-8"))
        config = {"tokenizer_class": "CLIPTokenizer", "bos_token": self.bos_token, "eos_token": self.eos_token,
                  "unk_token": self.unk_token, "pad_token": self.pad_token, "model_max_length": self.model_max_length}
        write_json(folder / "tokenizer_config.json", config)
        return folder

    def decode(self, token_ids, skip_special_tokens=False):
        # Byte-level decoding leaves the `</w>` word ends in the text; transformers turns them into spaces.
        return super().decode(token_ids, skip_special_tokens).replace("</w>", " ").strip()


def _packaged_merges(needed):
    return parse_merges(read_packaged(CLIP_MERGES, needed).decode("utf-8"), f"packaged {CLIP_MERGES}")
