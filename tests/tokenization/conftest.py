"""Shared tokenizers for the tokenization tests: built once per session (the packaged ones take ~0.1 s each)."""
import gzip
import json
from pathlib import Path

import pytest

from flame_models.tokenization import CLIPTokenizer, T5Tokenizer, load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"

TINY_CORPUS = [f"a photo of a {color} {thing} {place}" for color in ("red", "blue", "green", "sks")
               for thing in ("cat", "dog", "cube", "house") for place in ("on a table", "in a field", "at night")]
TINY_CORPUS += ["[trigger] standing in the rain", "a cozy café, watercolor", "a tiny robot with big eyes"]


@pytest.fixture(scope="session")
def reference():
    with open(FIXTURES / "reference_ids.json", encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def clip_l():
    return load_tokenizer("clip_l")


@pytest.fixture(scope="session")
def clip_g():
    return load_tokenizer("clip_g")


@pytest.fixture(scope="session")
def t5():
    return load_tokenizer("t5")


@pytest.fixture(scope="session")
def tiny_spiece_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5_tiny_spiece")
    (folder / "spiece.model").write_bytes(gzip.decompress((FIXTURES / "tiny_t5_spiece.model.gz").read_bytes()))
    return folder


@pytest.fixture(scope="session")
def tiny_clip():
    return CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=600)


@pytest.fixture(scope="session")
def tiny_t5():
    return T5Tokenizer.train_tiny(TINY_CORPUS, vocab_size=96, model_max_length=32)
