"""Each model's rules and the call interface: shapes, special tokens, padding, truncation, bad input."""
import numpy as np
import pytest

from flame_models.tokenization import BatchEncoding

LONG = "a very long caption about a cat " * 90


@pytest.mark.parametrize("name,pad,bos", [("clip_l", 49407, 49406), ("clip_g", 0, 49406), ("t5", 0, None)])
def test_special_tokens_by_kind(request, name, pad, bos):
    tok = request.getfixturevalue(name)
    eos = 1 if name == "t5" else 49407
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (pad, bos, eos)
    ids = tok(["a cat", ""]).input_ids
    assert ids.dtype == np.int64 and ids.shape == (2, 512 if name == "t5" else 77)
    first = [] if bos is None else [bos]
    content = tok.encode("a cat")[len(first):-1]
    assert len(content) >= 2
    assert ids[0].tolist() == first + content + [eos] + [pad] * (ids.shape[1] - len(first) - len(content) - 1)
    assert ids[1].tolist() == first + [eos] + [pad] * (ids.shape[1] - len(first) - 1)


@pytest.mark.parametrize("name,max_length", [("clip_l", 77), ("clip_g", 77), ("t5", 512), ("t5", 256)])
def test_truncation_keeps_eos_last(request, name, max_length):
    tok = request.getfixturevalue(name)
    full = tok.encode(LONG)
    assert len(full) > 512
    enc = tok([LONG, "short"], max_length=max_length)
    row = enc.input_ids[0]
    assert row.shape == (max_length,) and row[-1] == tok.eos_token_id
    assert row[:-1].tolist() == full[:max_length - 1]  # the start is kept, the end is cut
    assert enc.attention_mask[0].sum() == max_length
    assert enc.attention_mask[1].sum() == len(tok.encode("short"))


def test_no_truncation_raises_naming_the_caption(clip_l):
    with pytest.raises(ValueError, match=r"caption 1 needs \d+ tokens, more than max_length=77"):
        clip_l(["ok", LONG], truncation=False)
    assert clip_l(["ok"], truncation=False).input_ids.shape == (1, 77)


def test_single_string_and_empty_batch(clip_l, t5):
    assert clip_l("a cat").input_ids.shape == (1, 77)
    empty = t5([], max_length=256)
    assert empty.input_ids.shape == (0, 256) and empty.input_ids.dtype == np.int64
    assert empty.attention_mask.shape == (0, 256)


def test_padding_modes(clip_l):
    caps = ["a cat", "a photo of a dog on a wooden table"]
    lengths = [len(clip_l.encode(c)) for c in caps]
    longest = clip_l(caps, padding="longest")
    assert longest.input_ids.shape == (2, max(lengths))
    assert longest.attention_mask.sum(axis=1).tolist() == lengths
    assert clip_l(caps, padding=True).input_ids.tolist() == longest.input_ids.tolist()
    lists = clip_l(caps, padding=False, return_tensors=None)
    assert [len(r) for r in lists.input_ids] == lengths and lists.attention_mask == [[1] * n for n in lengths]
    with pytest.raises(ValueError, match="different lengths"):
        clip_l(caps, padding=False)
    with pytest.raises(ValueError, match="padding must be"):
        clip_l(caps, padding="max")
    with pytest.raises(ValueError, match="padding must be"):
        clip_l(caps, padding=1)


def test_attention_mask_optional_and_attribute_access(t5):
    enc = t5(["a cat"], max_length=16, return_attention_mask=False)
    assert isinstance(enc, BatchEncoding) and list(enc) == ["input_ids"]
    assert enc.input_ids is enc["input_ids"]
    with pytest.raises(AttributeError, match="attention_mask"):
        enc.attention_mask


@pytest.mark.parametrize("bad,error,match", [
    (None, TypeError, "captions must be a str or a list"),
    (("ok", 3), TypeError, "caption 1 is a int"),
    ([b"bytes"], TypeError, "caption 0 is a bytes"),
    (["ok", "lone \ud800 surrogate"], ValueError, "caption 1 is not valid Unicode"),
])
def test_bad_captions(clip_l, t5, bad, error, match):
    for tok in (clip_l, t5):
        with pytest.raises(error, match=match):
            tok(bad)


def test_bad_arguments(clip_l, t5):
    with pytest.raises(ValueError, match="no room for the 2 special"):
        clip_l(["a"], max_length=1)
    assert t5(["a"], max_length=1).input_ids.tolist() == [[1]]
    with pytest.raises(TypeError, match="max_length must be an int"):
        clip_l(["a"], max_length="77")
    with pytest.raises(TypeError, match="truncation must be True or False"):
        clip_l(["a"], truncation="longest_first")
    with pytest.raises(ValueError, match="return_tensors must be 'np' or None"):
        clip_l(["a"], return_tensors="pt")
    with pytest.raises(ValueError, match="only with truncation=True"):
        clip_l.encode("a", max_length=10)
    with pytest.raises(TypeError, match="encode takes one caption"):
        clip_l.encode(["a"])


def test_encode_counts_tokens_beyond_the_limit(clip_l):
    full = clip_l.encode(LONG)
    assert len(full) > clip_l.model_max_length
    assert full[0] == 49406 and full[-1] == 49407
    cut = clip_l.encode(LONG, truncation=True)
    assert cut == full[:76] + [49407]
    assert clip_l.encode(LONG, truncation=True, max_length=10) == full[:9] + [49407]


def test_clip_normalisation(clip_l):
    # NFC, whitespace runs -> one space, lower case: these spellings are the same caption.
    same = ["A Photo of  a\tCAT", "a photo of a cat", "  a photo\nof a cat  ", "a\u00a0photo of a cat"]
    rows = clip_l(same).input_ids
    assert all(r.tolist() == rows[1].tolist() for r in rows)
    assert clip_l.encode("e\u0301") == clip_l.encode("\u00e9")


def test_t5_whitespace_runs_count_once(t5):
    assert t5.encode("a  photo\tof\n\na cat ") == t5.encode("a photo of a cat") == [3, 9, 1202, 13, 3, 9, 1712, 1]


def test_special_token_text_is_split_out(clip_l, clip_g, t5):
    # transformers' behaviour: registered special tokens typed in a caption are matched before normalisation.
    assert clip_l.encode("x<|endoftext|>y") == [49406, 343, 49407, 344, 49407]
    assert clip_l.encode("wow!")[2] == 256 and clip_g.encode("wow!")[2] == 0  # CLIP-G: "!" is its pad token
    assert t5.encode("x</s>")[-2:] == [1, 1]
    assert t5.convert_ids_to_tokens(t5.encode("<extra_id_0>")) == ["<extra_id_0>", "</s>"]


def test_decode_and_ids_checks(clip_l, t5):
    assert clip_l.decode(clip_l("A Photo of a CAT!").input_ids[0], skip_special_tokens=True) == "a photo of a cat !"
    assert t5.decode(t5("a photo of a cat").input_ids[0], skip_special_tokens=True) == "a photo of a cat"
    assert t5.decode([9, 1]) == "a</s>"
    assert clip_l.decode([]) == t5.decode(np.array([], dtype=np.int64)) == ""
    with pytest.raises(ValueError, match=r"token id 49408 is outside this tokenizer's vocabulary \[0, 49408\)"):
        clip_l.decode([49406, 49408])
    with pytest.raises(ValueError, match="1-D sequence of ints"):
        t5.decode([[1, 2]])


def test_repr_names_source_and_rules(clip_g):
    text = repr(clip_g)
    assert "packaged" in text and "model_max_length=77" in text and "pad='!' (0)" in text


def test_pickles_for_data_loader_workers(clip_g, t5, tiny_t5):
    import pickle
    for tok in (clip_g, t5, tiny_t5):
        again = pickle.loads(pickle.dumps(tok))
        assert again(["a cat!", "東京"]).input_ids.tolist() == tok(["a cat!", "東京"]).input_ids.tolist()
