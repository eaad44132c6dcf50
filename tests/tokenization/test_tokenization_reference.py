"""Token ids of awkward captions against transformers' CLIPTokenizer / T5Tokenizer built from the same vocabulary
files (tests/fixtures/make_tokenizer_fixtures.py), through every way the vocabulary can reach FLAME."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import BPE

from flame_models.tokenization import CLIPTokenizer, T5Tokenizer
from flame_models.tokenization.clip import vocab_from_merges

VOCAB = Path(__file__).resolve().parents[2] / "flame_models" / "tokenization" / "vocab"


def check_case(tokenizer, reference, name):
    case = reference["cases"][name]
    enc = tokenizer(reference["captions"], max_length=case["max_length"], padding=case["padding"])
    expected = np.array(case["input_ids"], dtype=np.int64)
    assert enc.input_ids.dtype == np.int64 and enc.input_ids.shape == expected.shape
    for i, caption in enumerate(reference["captions"]):
        assert enc.input_ids[i].tolist() == case["input_ids"][i], f"{name}: caption {i} {caption[:40]!r}"
    np.testing.assert_array_equal(enc.attention_mask, np.array(case["attention_mask"]))
    assert tokenizer.batch_decode(enc.input_ids, skip_special_tokens=True) == case["decoded"]


def test_fixture_was_made_from_the_packaged_vocabularies(reference):
    # A changed vocabulary file must fail here, not as a puzzling id mismatch below.
    for name, digest in reference["vocab_sha256"].items():
        assert hashlib.sha256((VOCAB / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name,kind", [("clip_l", "clip_l"), ("clip_l_longest", "clip_l"),
                                       ("clip_g", "clip_g"), ("clip_g_short", "clip_g")])
def test_packaged_clip_matches_transformers(reference, clip_l, clip_g, name, kind):
    check_case({"clip_l": clip_l, "clip_g": clip_g}[kind], reference, name)


@pytest.mark.parametrize("name", ["t5_512", "t5_256"])
def test_packaged_t5_matches_transformers(reference, t5, name):
    check_case(t5, reference, name)


@pytest.mark.parametrize("name", ["t5_tiny_spiece_64", "t5_tiny_spiece_8"])
def test_spiece_only_folder_matches_transformers(reference, tiny_spiece_folder, name):
    tokenizer = T5Tokenizer.from_pretrained(tiny_spiece_folder)
    assert type(tokenizer.backend).__name__ == "SentencePieceBackend"
    check_case(tokenizer, reference, name)


def test_known_clip_ids(clip_l):
    # Real vocab.json ids (openai/clip-vit-large-patch14), independent of how the vocabulary is rebuilt here.
    assert clip_l("a photo of a cat").input_ids[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407, 49407]
    assert clip_l.convert_tokens_to_ids(["!", "!</w>", "a</w>", "<|startoftext|>", "<|endoftext|>"]) == \
        [0, 256, 320, 49406, 49407]


def test_clip_vocab_json_folders_match(reference, clip_l, clip_g, tmp_path):
    clip_l.save_pretrained(tmp_path / "tokenizer")
    clip_g.save_pretrained(tmp_path / "tokenizer_2")
    assert (tmp_path / "tokenizer" / "merges.txt").read_bytes().startswith(b"#version: 0.2\n")
    check_case(CLIPTokenizer.from_pretrained(tmp_path / "tokenizer"), reference, "clip_l")
    check_case(CLIPTokenizer.from_pretrained(tmp_path, kind="clip_g"), reference, "clip_g")


@pytest.mark.parametrize("pairs", [False, True], ids=["merges-as-strings", "merges-as-pairs"])
def test_clip_tokenizer_json_folder_matches(reference, clip_l, tmp_path, pairs):
    # A tokenizer.json written by the tokenizers library itself; both merge layouts it has used over versions.
    tokenizer = Tokenizer(BPE(vocab=clip_l.vocab, merges=clip_l.merges, end_of_word_suffix="</w>",
                              continuing_subword_prefix="", unk_token="<|endoftext|>"))
    data = json.loads(tokenizer.to_str())
    data["model"]["merges"] = [list(m) if pairs else " ".join(m) for m in clip_l.merges]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    check_case(CLIPTokenizer.from_pretrained(tmp_path), reference, "clip_l")


def test_t5_tokenizer_json_folder_matches(reference, t5, tmp_path):
    folder = t5.save_pretrained(tmp_path / "tokenizer_2")
    assert json.loads((folder / "tokenizer_config.json").read_text())["extra_ids"] == 100
    check_case(T5Tokenizer.from_pretrained(tmp_path), reference, "t5_512")
    check_case(T5Tokenizer.from_pretrained(tmp_path, max_length=256), reference, "t5_256")


def test_vocab_from_merges_layout(clip_l):
    assert len(clip_l.vocab) == clip_l.vocab_size == 49408
    assert clip_l.vocab == vocab_from_merges(clip_l.merges)
    assert sorted(clip_l.vocab.values()) == list(range(49408))
