"""data/text_trim.py: the run-wide cut of the text tokens no attention sees, and the cache's one-array read it is
planned from."""
import numpy as np
import pytest

from flame_models.data import TextEmbeddingCache
from flame_models.data.errors import DataError
from flame_models.data.text_trim import TextTrim


def _item(n_real, full=8, d=3):
    mask = (np.arange(full) < n_real).astype(np.float32)
    return {"prompt_embeds": np.arange(full * d, dtype=np.float32).reshape(full, d), "prompt_mask": mask,
            "pooled": np.ones(2, np.float32)}


def test_captions_of_different_lengths_are_cut_to_the_longest_and_keep_their_masks():
    trim = TextTrim()
    assert trim.plan([3, 6, 2], full_length=8) == 6 and trim.active and trim.keep_mask
    out = trim.apply(_item(2))
    assert out["prompt_embeds"].shape == (6, 3) and out["prompt_mask"].tolist() == [1, 1, 0, 0, 0, 0]
    np.testing.assert_array_equal(out["prompt_embeds"], _item(2)["prompt_embeds"][:6])
    assert out["pooled"].shape == (2,)                                        # other arrays untouched
    assert "8 -> 6 tokens" in trim.describe() and "masks kept" in trim.describe()


def test_captions_of_one_length_are_cut_and_lose_the_mask():
    trim = TextTrim()
    assert trim.plan([5, 5], full_length=8) == 5 and not trim.keep_mask
    out = trim.apply(_item(4))
    assert out["prompt_embeds"].shape == (5, 3) and "prompt_mask" not in out
    assert "no mask left" in trim.describe()


def test_nothing_is_cut_when_a_caption_fills_the_text():
    trim = TextTrim()
    assert trim.plan([8, 3], full_length=8) is None and not trim.active
    item = _item(3)
    assert trim.apply(item) is item and trim.describe() == "text: no token cut"
    assert trim.plan([8, 8], full_length=8) == 8 and not trim.keep_mask      # all full: the mask alone goes
    assert "prompt_mask" not in trim.apply(_item(8))


def test_bad_prefixes_and_items_are_named():
    trim = TextTrim()
    with pytest.raises(DataError, match=r"attended prefixes must be in \[1, 8\]"):
        trim.plan([0, 3], full_length=8)
    with pytest.raises(DataError, match=r"attended prefixes must be in \[1, 8\]"):
        trim.plan([9], full_length=8)
    trim.plan([3, 4], full_length=8)
    with pytest.raises(DataError, match=r"prompt_embeds \(8, D\) and prompt_mask \(8,\), got \(7, 3\)"):
        trim.apply({"prompt_embeds": np.zeros((7, 3)), "prompt_mask": np.zeros(7)})


@pytest.mark.parametrize("on_disk", [False, True])
def test_the_text_cache_reads_one_array_of_an_entry(tmp_path, on_disk):
    cache = TextEmbeddingCache(str(tmp_path / "t") if on_disk else None, "enc")
    cache.fill(["a cat", "a dog"], lambda ps: {"prompt_embeds": np.ones((len(ps), 4, 2), np.float32),
                                               "prompt_mask": np.array([[1, 1, 0, 0]] * len(ps), np.float32)},
               progress=False)
    assert cache.load_array("a cat", "prompt_mask").tolist() == [1, 1, 0, 0]
    assert cache.load_array("a dog", "pooled") is None
    with pytest.raises(DataError, match="text embeddings of 'a bird'"):
        cache.load_array("a bird", "prompt_mask")
