"""FLAME's Qwen2Tokenizer (flame_models/tokenization/qwen2.py) on the tiny folder tests/fixtures/qwen_image_tokenizer/:
special tokens whole at their config ids, right padding with the pad token, truncation, tokenizer.json read the same
as vocab.json + merges.txt, and bad folders named. Its ids against transformers' Qwen2Tokenizer are checked in
tests/models/test_qwen_image_parity.py."""
import os
import shutil

import numpy as np
import pytest

from flame_models.qwen_image.conditioning import PROMPT_TEMPLATE
from flame_models.tokenization.errors import TokenizerFilesError
from flame_models.tokenization.qwen2 import Qwen2Tokenizer

FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "qwen_image_tokenizer")


def test_special_tokens_padding_and_truncation():
    tok = Qwen2Tokenizer.from_folder(FOLDER)
    assert len(tok) == 403 and tok.pad_token_id == 400
    start, end = tok.tokenizer.token_to_id("<|im_start|>"), tok.tokenizer.token_to_id("<|im_end|>")
    assert (start, end) == (401, 402)
    ids, mask = tok([PROMPT_TEMPLATE.format("a cat"), PROMPT_TEMPLATE.format("a much longer caption, 123")])
    assert ids.dtype == np.int64 and ids.shape == mask.shape and mask[0].sum() < mask[1].sum()
    n = mask[0].sum()
    assert ids[0, 0] == start and (ids[0, n:] == 400).all() and not mask[0, n:].any()
    assert list(ids[0]).count(start) == 3 and list(ids[0]).count(end) == 2
    assert tok.encode("a<|im_end|>b") == tok.encode("a") + [end] + tok.encode("b")      # whole, never split
    cut, cmask = tok([PROMPT_TEMPLATE.format("a cat")], max_length=5)
    assert cut.shape == (1, 5) and cmask.all() and list(cut[0]) == list(ids[0, :5])


def test_a_tokenizer_json_gives_the_same_ids(tmp_path):
    tok = Qwen2Tokenizer.from_folder(FOLDER)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copy(os.path.join(FOLDER, "tokenizer_config.json"), folder)
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    other = Qwen2Tokenizer.from_folder(str(tmp_path))                  # a pipeline folder: its tokenizer/
    texts = [PROMPT_TEMPLATE.format(p) for p in ("naïve café, 猫", "it's 42\n\nok")]
    for a, b in zip(tok(texts), other(texts)):
        np.testing.assert_array_equal(a, b)


def test_bad_tokenizer_folders_are_named(tmp_path):
    with pytest.raises(TokenizerFilesError, match="not a Qwen2 tokenizer folder.*vocab.json, merges.txt"):
        Qwen2Tokenizer.from_folder(str(tmp_path))
    for f in ("vocab.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FOLDER, f), tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(TokenizerFilesError, match=r"merges.txt, line 2: a merge is two tokens"):
        Qwen2Tokenizer.from_folder(str(tmp_path))
