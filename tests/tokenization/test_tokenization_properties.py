"""Hypothesis: any Unicode caption (no lone surrogates: those are rejected with a ValueError) gives exactly
max_length ids with the special tokens in place, and the same ids one at a time as in a batch."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

captions = st.lists(st.text(max_size=400) | st.text(alphabet=" \t\n!<|>/sendoftxa_0123", max_size=60),
                    min_size=1, max_size=4)


def check_rows(tok, texts, max_length):
    enc = tok(texts, max_length=max_length)
    ids, mask = enc.input_ids, enc.attention_mask
    assert ids.dtype == np.int64 and ids.shape == (len(texts), max_length) and mask.shape == ids.shape
    assert ((ids >= 0) & (ids < tok.vocab_size)).all()
    for text, row, m in zip(texts, ids, mask):
        k = int(m.sum())
        assert (m[:k] == 1).all() and (m[k:] == 0).all()
        assert row[k - 1] == tok.eos_token_id and (row[k:] == tok.pad_token_id).all()
        if tok.bos_token_id is not None:
            assert row[0] == tok.bos_token_id and k >= 2
            assert tok.bos_token_id not in row[1:k - 1].tolist()
        full = tok.encode(text)
        assert row[:k].tolist() == (full if len(full) <= max_length else full[:max_length - 1] + [tok.eos_token_id])


@given(texts=captions, max_length=st.integers(2, 80))
def test_clip_l_any_text(clip_l, texts, max_length):
    check_rows(clip_l, texts, max_length)


@given(texts=captions, max_length=st.integers(2, 80))
def test_clip_g_any_text(clip_g, texts, max_length):
    check_rows(clip_g, texts, max_length)


@given(texts=captions, max_length=st.integers(1, 80))
def test_t5_any_text(t5, texts, max_length):
    check_rows(t5, texts, max_length)


@given(texts=captions, max_length=st.integers(1, 40))
def test_t5_spiece_any_text(tiny_spiece_folder, texts, max_length):
    from flame_models.tokenization import T5Tokenizer
    check_rows(T5Tokenizer.from_pretrained(tiny_spiece_folder), texts, max_length)


@given(texts=captions)
def test_tiny_tokenizers_any_text(tiny_clip, tiny_t5, texts):
    check_rows(tiny_clip, texts, 77)
    check_rows(tiny_t5, texts, 32)


@given(text=st.text(max_size=40), bad=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))
def test_lone_surrogates_are_rejected_clearly(clip_l, t5, text, bad):
    for tok in (clip_l, t5):
        with pytest.raises(ValueError, match="caption 1 is not valid Unicode"):
            tok(["fine", text + bad])
