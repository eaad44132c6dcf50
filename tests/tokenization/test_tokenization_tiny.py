"""Tiny tokenizers trained at run time for the built-in demo: fast, deterministic, same rules as the real ones."""
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_CORPUS

from flame_models.tokenization import CLIPTokenizer, T5Tokenizer
from flame_models.tokenization.bpe_training import learn_bpe_merges

ROOT = Path(__file__).resolve().parents[2]


def test_bpe_learner_on_a_worked_example():
    # Sennrich et al.'s example words; "</w>" rides on the last symbol as in CLIP. Ties go to the smaller pair:
    # (e, s) and (s, t</w>) both occur 9 times; later (e, w), (n, e) and (w, est</w>) 6 times each.
    words = {("l", "o", "w</w>"): 5, ("l", "o", "w", "e", "r</w>"): 2,
             ("n", "e", "w", "e", "s", "t</w>"): 6, ("w", "i", "d", "e", "s", "t</w>"): 3}
    assert learn_bpe_merges(words, 4) == [("e", "s"), ("es", "t</w>"), ("l", "o"), ("e", "w")]
    frequent = learn_bpe_merges(words, 100, min_frequency=6)
    assert frequent[4:] == [("ew", "est</w>"), ("n", "ewest</w>")]  # then (lo, w</w>) has only 5
    assert len(learn_bpe_merges(words, 100, min_frequency=1)) == 13  # every word one token


def test_tiny_clip_layout_and_rules(tiny_clip):
    n = tiny_clip.vocab_size
    assert 514 < n <= 600
    assert (tiny_clip.bos_token_id, tiny_clip.eos_token_id, tiny_clip.pad_token_id) == (n - 2, n - 1, n - 1)
    assert tiny_clip.convert_tokens_to_ids(["!", "!</w>"]) == [0, 256]  # CLIP's byte order
    g = CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=600, kind="clip_g")
    assert g.pad_token_id == 0 and g.vocab == tiny_clip.vocab
    enc = tiny_clip(TINY_CORPUS[:3] + ["unseen wörds 🐱"], max_length=16)
    assert enc.input_ids.shape == (4, 16)
    for row, mask in zip(enc.input_ids, enc.attention_mask):
        k = int(mask.sum())
        assert row[0] == n - 2 and row[k - 1] == n - 1 and (row[k:] == n - 1).all()
    # The merges were learned: every word of a training caption is one token.
    assert len(tiny_clip.encode(TINY_CORPUS[0])) == len(TINY_CORPUS[0].split()) + 2
    assert tiny_clip.decode(tiny_clip.encode("a red cat"), skip_special_tokens=True) == "a red cat"


def test_tiny_t5_layout_and_rules(tiny_t5):
    assert (tiny_t5.pad_token_id, tiny_t5.eos_token_id, tiny_t5.unk_token_id) == (0, 1, 2)
    assert tiny_t5.model_max_length == 32 and tiny_t5.vocab_size <= 96
    enc = tiny_t5(TINY_CORPUS[:3] + ["unseen 日本"])
    assert enc.input_ids.shape == (4, 32)
    for row, mask in zip(enc.input_ids, enc.attention_mask):
        k = int(mask.sum())
        assert row[k - 1] == 1 and (row[k:] == 0).all() and (row[:k - 1] > 1).all()
    assert 2 not in tiny_t5.encode(TINY_CORPUS[5])  # every character of the corpus is in the vocabulary
    assert tiny_t5.decode(tiny_t5.encode("a red cat"), skip_special_tokens=True) == "a red cat"


def test_training_is_fast():
    start = time.perf_counter()
    CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=600)
    T5Tokenizer.train_tiny(TINY_CORPUS, vocab_size=96)
    # Well under a second on an idle core; the bound leaves room for a loaded CI machine.
    assert time.perf_counter() - start < 3.0


_DIGEST = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests/tokenization")
from conftest import TINY_CORPUS
from flame_models.tokenization import CLIPTokenizer, T5Tokenizer
c = CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=600)
t = T5Tokenizer.train_tiny(TINY_CORPUS, vocab_size=96)
print(hashlib.sha256(json.dumps(c.merges).encode()).hexdigest(), hashlib.sha256(t.backend.model_proto).hexdigest())
"""


def test_training_is_deterministic_across_processes(tiny_clip, tiny_t5):
    # Hash-map order changes between processes: two fresh interpreters must learn the very same vocabularies.
    here = (hashlib.sha256(json.dumps(tiny_clip.merges).encode()).hexdigest(),
            hashlib.sha256(tiny_t5.backend.model_proto).hexdigest())
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _DIGEST, str(ROOT)], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert tuple(out.stdout.split()) == here


def test_bad_training_arguments():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 514"):
        CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=100)
    with pytest.raises(TypeError, match="corpus must be a list of str"):
        CLIPTokenizer.train_tiny("one string")
    with pytest.raises(TypeError, match="corpus must be a non-empty list of str"):
        T5Tokenizer.train_tiny([])
    with pytest.raises(ValueError, match="kind must be 'clip_l' or 'clip_g'"):
        CLIPTokenizer.train_tiny(TINY_CORPUS, kind="t5")
