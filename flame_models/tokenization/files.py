"""Finding a tokenizer's folder inside a model folder and reading its configuration files.

Layouts understood: a diffusers model folder (`tokenizer/`, `tokenizer_2/`, `tokenizer_3/`), a transformers
tokenizer folder, or the path of one of its files. A tokenizer folder holds `tokenizer.json`, or `vocab.json` +
`merges.txt` (BPE), or `spiece.model` (SentencePiece), plus optionally `tokenizer_config.json` and
`special_tokens_map.json` (special tokens, `model_max_length`, `extra_ids`).
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TokenizerFilesError

TOKENIZER_SUBFOLDERS = ("tokenizer", "tokenizer_2", "tokenizer_3")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "spiece.model",
                   "tokenizer_config.json", "special_tokens_map.json")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers writes int(1e30) when a tokenizer has no length limit.
_NO_LIMIT = 10 ** 6


def read_json(path):
    """A JSON file's content; a clear error naming the file when it is not valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a valid JSON file: {e}") from None


def model_type(folder):
    """'bpe', 'unigram', another tokenizers model type in lower case, or None when `folder` holds no tokenizer."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        data = read_json(folder / "tokenizer.json")
        kind = data.get("model", {}).get("type") if isinstance(data, dict) else None
        if kind is None:
            raise ValueError(f"{folder / 'tokenizer.json'} has no model.type: not a tokenizers file")
        return str(kind).lower()
    has_vocab, has_merges = (folder / "vocab.json").is_file(), (folder / "merges.txt").is_file()
    if has_vocab and has_merges:
        return "bpe"
    if has_vocab != has_merges and not (folder / "spiece.model").is_file():
        missing = "merges.txt" if has_vocab else "vocab.json"
        raise TokenizerFilesError(f"{folder} has {'vocab.json' if has_vocab else 'merges.txt'} but no {missing}: "
                                  "a BPE tokenizer needs both (or a tokenizer.json)")
    if (folder / "spiece.model").is_file():
        return "unigram"
    return None


def _describe(kind):
    return {"bpe": "a BPE (CLIP-style)", "unigram": "a Unigram/SentencePiece (T5-style)"}.get(kind, f"a {kind}")


def find_tokenizer_folder(path, *, want, label, subfolder=None, subfolders=TOKENIZER_SUBFOLDERS):
    """The tokenizer folder for a model of tokenizer type `want` ('bpe' or 'unigram') under `path`.

    `path` is a tokenizer folder, one of its files, or a model folder whose `subfolders` are searched in order
    (the first holding a `want` tokenizer wins); `subfolder` names the one to use. Raises TokenizerFilesError
    naming the folder that is needed.
    """
    files = {"bpe": "tokenizer.json, or vocab.json + merges.txt", "unigram": "tokenizer.json or spiece.model"}[want]
    hint = (f"pass the model folder (holding {', '.join(s + '/' for s in subfolders)}) or the {label} tokenizer "
            f"folder itself ({files}), or path=None to use the vocabulary packaged with FLAME")
    root = Path(path).expanduser()
    if not root.exists():
        raise TokenizerFilesError(f"{label} tokenizer: {root} does not exist; {hint}")
    if root.is_file():
        if root.name not in TOKENIZER_FILES:
            raise TokenizerFilesError(
                f"{label} tokenizer: {root} is a file, not a tokenizer folder (a single-file checkpoint carries no "
                f"tokenizer); {hint}")
        root = root.parent
    if subfolder is not None:
        folder = root / subfolder
        kind = model_type(folder) if folder.is_dir() else None
        if kind is None:
            raise TokenizerFilesError(f"{label} tokenizer: no tokenizer files in {folder}; {hint}")
        if kind != want:
            raise TokenizerFilesError(f"{label} tokenizer: {folder} holds {_describe(kind)} tokenizer, "
                                      f"not {_describe(want)} one")
        return folder
    kind = model_type(root)
    if kind == want:
        return root
    if kind is not None:
        raise TokenizerFilesError(f"{label} tokenizer: {root} holds {_describe(kind)} tokenizer, "
                                  f"not {_describe(want)} one")
    for name in subfolders:
        if (root / name).is_dir() and model_type(root / name) == want:
            return root / name
    raise TokenizerFilesError(f"{label} tokenizer: no {label} tokenizer files in {root} or in its "
                              f"{', '.join(s + '/' for s in subfolders)}; {hint}")


def _token_content(value):
    # Older files store special tokens as AddedToken dicts ({"content": "!", "__type": "AddedToken", ...}).
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class TokenizerConfig:
    """What a tokenizer folder's config files say about special tokens and length (None where they say nothing)."""
    special_tokens: dict = field(default_factory=dict)
    model_max_length: int | None = None
    extra_ids: int | None = None


def read_tokenizer_config(folder):
    """The special tokens, `model_max_length` and `extra_ids` set by `folder`'s tokenizer_config.json, with
    special_tokens_map.json taking precedence when the config has no `added_tokens_decoder` (transformers' rule)."""
    folder = Path(folder)
    config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'tokenizer_config.json'} must hold a JSON object, not {type(config).__name__}")
    tokens = {k: _token_content(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    if "added_tokens_decoder" not in config and (folder / "special_tokens_map.json").is_file():
        token_map = read_json(folder / "special_tokens_map.json")
        if not isinstance(token_map, dict):
            raise ValueError(f"{folder / 'special_tokens_map.json'} must hold a JSON object")
        tokens.update({k: _token_content(token_map[k]) for k in SPECIAL_TOKEN_KEYS if k in token_map})
    length = config.get("model_max_length")
    length = length if isinstance(length, int) and not isinstance(length, bool) and 0 < length < _NO_LIMIT else None
    extra_ids = config.get("extra_ids")
    extra_ids = extra_ids if isinstance(extra_ids, int) and not isinstance(extra_ids, bool) and extra_ids >= 0 else None
    return TokenizerConfig({k: v for k, v in tokens.items() if v is not None}, length, extra_ids)


def first_given(*values):
    """The first value that is not None (explicit argument, then the folder's config, then the default)."""
    return next((v for v in values if v is not None), None)
