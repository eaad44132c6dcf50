"""Caption rules: trigger word, dropout (rate and determinism), tag shuffling with keep_tokens, caption files."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from make_images import write_caption, write_image

from flame_models.data import DataError, DatasetConfig, ImageDataset, apply_trigger, read_caption, split_tags
from flame_models.data.captions import CaptionRule, shuffle_tags


def rule(seed=0, trigger=None, **kw):
    return CaptionRule(DatasetConfig(folder_path="x", **kw), seed, trigger)


def test_trigger_word_like_ai_toolkit():
    assert apply_trigger("a photo of [trigger] at the beach", "ohwx") == "a photo of ohwx at the beach"
    assert apply_trigger("[name], smiling", "ohwx") == "ohwx, smiling"
    assert apply_trigger("a dog on grass", "ohwx") == "ohwx a dog on grass"        # added when missing
    assert apply_trigger("ohwx dog", "ohwx") == "ohwx dog"                          # not twice
    assert apply_trigger("a photo of [trigger]", None) == "a photo of"              # removed without a trigger
    assert apply_trigger("a dog", "ohwx", add_if_missing=False) == "a dog"          # sample prompts
    r = rule(trigger="sks")
    assert r.base("a cat") == "sks a cat" and r.dropout_caption == "sks"
    assert rule(trigger="sks", trigger_word="own").base("a cat") == "own a cat"     # the folder's own trigger wins
    assert rule().dropout_caption == ""


def test_kohyas_caption_prefix_and_suffix():
    """kohya's caption_prefix / caption_suffix: joined with a space before the trigger is placed and the tags
    shuffled (keep_tokens counts the prefix's tag); the dropout caption stays the trigger alone."""
    r = rule(trigger="sks", caption_prefix="photo,", caption_suffix=", 4k")
    assert r.base("a cat") == "sks photo, a cat , 4k" and r.dropout_caption == "sks"
    assert rule(caption_prefix="[trigger] style,").base("a dog") == "style, a dog"       # (no trigger: removed)
    assert rule(trigger="ohwx", caption_prefix="[trigger] style,").base("a dog") == "ohwx style, a dog"
    shuffled = rule(shuffle_tokens=True, keep_tokens=1, caption_prefix="masterpiece,")
    for epoch in range(4):
        got = shuffled.caption(shuffled.base("red, round, small"), "k", epoch)
        assert got.startswith("masterpiece, ") and sorted(split_tags(got)[1:]) == ["red", "round", "small"]


def test_kohyas_keep_tokens_separator():
    """'fixed ||| shuffled ||| fixed at the end': written without the separator; only the middle tags shuffle (kohya's
    keep_tokens_separator; keep_tokens is then unused); a caption without it follows keep_tokens."""
    r = rule(shuffle_tokens=True, keep_tokens=3, keep_tokens_separator="|||", trigger="sks")
    base = r.base("1girl, solo ||| red hair, smile, outdoors, hat ||| masterpiece")
    assert base == "sks 1girl, solo, red hair, smile, outdoors, hat, masterpiece"
    seen = set()
    for epoch in range(12):
        tags = split_tags(r.caption(base, "k", epoch))
        assert tags[:2] == ["sks 1girl", "solo"] and tags[-1] == "masterpiece"
        assert sorted(tags[2:-1]) == ["hat", "outdoors", "red hair", "smile"]
        seen.add(tuple(tags))
    assert len(seen) > 1
    two = r.base("a, b ||| c, d, e")                                   # no second separator: nothing kept last
    assert all(split_tags(r.caption(two, "j", e))[:2] == ["sks a", "b"] for e in range(6))
    plain = r.base("x, y, z, w")                                       # without the separator: keep_tokens 3
    assert all(split_tags(r.caption(plain, "p", e))[:3] == ["sks x", "y", "z"] for e in range(4))
    assert rule(keep_tokens_separator="|||").base("a ||| b") == "a, b"   # not shuffling: still written without it


def test_dropout_rate_statistics_and_determinism():
    r = rule(seed=7, caption_dropout_rate=0.25)
    draws = np.array([[r.dropped(f"s{k}", e) for e in range(40)] for k in range(100)])   # 4000 draws
    assert abs(draws.mean() - 0.25) < 4 * np.sqrt(0.25 * 0.75 / draws.size)
    assert 0.1 < draws.mean(axis=0).min() and draws.mean(axis=0).max() < 0.45          # every epoch drops some
    again = np.array([[rule(seed=7, caption_dropout_rate=0.25).dropped(f"s{k}", e) for e in range(40)]
                      for k in range(100)])
    assert (draws == again).all()                                                      # same seed: same draws
    other = np.array([[rule(seed=8, caption_dropout_rate=0.25).dropped(f"s{k}", e) for e in range(40)]
                      for k in range(100)])
    assert (draws != other).mean() > 0.2
    assert r.caption("ohwx a cat", "s0", int(np.argmax(draws[0]))) == ""
    assert not rule(caption_dropout_rate=0.0).dropped("a", 0) and rule(caption_dropout_rate=1.0).dropped("a", 0)


@given(tags=st.lists(st.text("abcdefgh ", min_size=1, max_size=6).filter(lambda t: t.strip()), min_size=1,
                     max_size=9), keep=st.integers(0, 4), seed=st.integers(0, 2 ** 31))
def test_shuffle_keeps_the_first_tags_and_every_tag(tags, keep, seed):
    caption = ", ".join(tags)
    out = shuffle_tags(caption, np.random.default_rng(seed), keep, ",")
    before, after = split_tags(caption), split_tags(out)
    assert sorted(after) == sorted(before)
    assert after[:keep] == before[:keep]


def test_shuffle_varies_by_epoch_and_repeats_with_variants():
    caption = "ohwx, one, two, three, four, five, six"
    r = rule(seed=3, shuffle_tokens=True, keep_tokens=1)
    orders = [r.caption(caption, "k", e) for e in range(6)]
    assert all(o.startswith("ohwx, ") for o in orders)
    assert len(set(orders)) >= 5                                                        # 720 orders: all differ
    assert orders == [rule(seed=3, shuffle_tokens=True, keep_tokens=1).caption(caption, "k", e) for e in range(6)]
    assert r.caption(caption, "k", 0) != r.caption(caption, "other", 0)
    r3 = rule(seed=3, shuffle_tokens=True, keep_tokens=1, shuffle_variants=3)
    c3 = [r3.caption(caption, "k", e) for e in range(9)]
    assert c3[:3] == c3[3:6] == c3[6:9] and len(set(c3)) == 3
    assert rule(seed=3, keep_tokens=1).caption(caption, "k", 4) == caption             # no shuffle: unchanged
    assert shuffle_tags("a|b|c", np.random.default_rng(0), 0, "|").count("| ") == 2  # joined with the separator


def test_variants_cover_every_caption_drawn():
    caption = "ohwx, one, two, three"
    for kw in ({"shuffle_tokens": True, "caption_dropout_rate": 0.3}, {"caption_dropout_rate": 0.5},
               {"shuffle_tokens": True, "shuffle_variants": 2}, {}):
        r = rule(seed=1, trigger="ohwx", **kw)
        drawn = {r.caption(caption, f"s{k}", e, f"t{k}") for k in range(5) for e in range(7)}
        listed = set().union(*(r.variants_over(caption, f"t{k}", range(7)) for k in range(5)))
        assert drawn <= listed
        assert len(listed) <= 5 * 7 + 1


def test_caption_files(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes("\ufeff  a caf\u00e9, by the sea \n\n".encode("utf-8"))
    assert read_caption(str(p)) == "a caf\u00e9, by the sea"
    p.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(DataError, match=r"a\.txt: the caption file is not UTF-8"):
        read_caption(str(p))


def test_dataset_captions(tmp_path):
    root = tmp_path / "d"
    write_caption(write_image(str(root / "a.png"), 64, 64), "a photo of [trigger], red")
    write_caption(write_image(str(root / "b.png"), 64, 64, seed=1), "", ext=".caption")
    write_image(str(root / "c.png"), 64, 64, seed=2)                                   # no caption file
    cfg = DatasetConfig(folder_path=str(root), resolution=64, caption_ext="caption", default_caption="a thing")
    with pytest.raises(DataError, match=r"a\.png: no caption file a\.caption") as ex:
        ImageDataset([DatasetConfig(folder_path=str(root), resolution=64, caption_ext=".caption")], progress=False)
    assert "c.png" in str(ex.value) and "default_caption" in str(ex.value)
    write_caption(str(root / "a.png"), "a photo of [trigger], red", ext=".caption")
    ds = ImageDataset([cfg], trigger_word="ohwx", progress=False)
    got = {ds.record(i).relpath: ds.caption(i, 0) for i in range(len(ds))}
    # an empty caption file and a missing one both fall back to default_caption (ai-toolkit does the same)
    assert got == {"a.png": "a photo of ohwx, red", "b.png": "ohwx a thing", "c.png": "ohwx a thing"}


def test_kohyas_caption_tag_dropout():
    """caption_tag_dropout_rate: per sample and epoch each tag but the kept ones is dropped (after shuffling, kohya's
    order), as a pure function of (seed, epoch, sample); every caption an epoch can draw is among variants_over."""
    r = rule(seed=3, caption_tag_dropout_rate=0.5, keep_tokens=1)
    base = r.base("ohwx, " + ", ".join(f"t{i}" for i in range(10)))
    drawn = [r.caption(base, "k", e) for e in range(40)]
    assert drawn == [r.caption(base, "k", e) for e in range(40)]                      # deterministic
    kept = np.mean([len(split_tags(c)) - 1 for c in drawn]) / 10
    assert 0.35 < kept < 0.65                                                          # about half kept
    for c in drawn:
        tags = split_tags(c)
        assert tags[0] == "ohwx" and tags[1:] == sorted(tags[1:], key=lambda t: int(t[1:]))   # kept first, in order
    assert len(set(drawn)) > 20 and set(drawn) <= set(r.variants_over(base, "k", range(40)))
    both = rule(seed=3, caption_tag_dropout_rate=0.3, shuffle_tokens=True, keep_tokens_separator="|||")
    b = both.base("a, b ||| c, d, e, f ||| z")
    for e in range(10):
        tags = split_tags(both.caption(b, "k", e))
        assert tags[:2] == ["a", "b"] and tags[-1] == "z" and set(tags[2:-1]) <= {"c", "d", "e", "f"}
    assert rule(caption_tag_dropout_rate=0.5, shuffle_variants=2).variants_over(base, "k", range(40)).__len__() <= 2


def test_keep_tokens_separator_is_checked():
    from flame_models.data.config import validate_dataset_config
    for bad in ("", ",", 3):
        got = validate_dataset_config(DatasetConfig(folder_path="x", keep_tokens_separator=bad), check_files=False)
        assert any("keep_tokens_separator: a non-empty string other than caption_separator" in e for e in got), bad
    assert validate_dataset_config(DatasetConfig(folder_path="x", keep_tokens_separator="|||"), check_files=False) == []
    got = validate_dataset_config(DatasetConfig(folder_path="x", caption_tag_dropout_rate=1.5), check_files=False)
    assert got == ["datasets[0].caption_tag_dropout_rate: a probability in [0, 1], got 1.5"]


def test_kohyas_secondary_separator_keeps_tags_together_and_becomes_the_separator():
    """kohya's secondary_separator: the tags it joins shuffle and drop as one tag (the caption splits on
    caption_separator only), and the caption trained on has it replaced by caption_separator -- without shuffling
    too, and in every variant encoded up front."""
    plain = rule(secondary_separator=";;;")
    assert plain.caption(plain.base("red;;;round, small"), "k", 0) == "red,round, small"
    r = rule(seed=1, shuffle_tokens=True, secondary_separator=";;;")
    base = r.base("red;;;round, small, blue;;;wet;;;cold, tall")
    seen = set()
    for epoch in range(12):
        got = r.caption(base, "k", epoch)
        assert ";;;" not in got
        assert "red,round" in got and "blue,wet,cold" in got   # never split apart by the shuffle
        seen.add(got)
    assert len(seen) > 1
    assert set(r.variants_over(base, "k", range(12))) == seen
    dropped = rule(seed=2, caption_tag_dropout_rate=0.5, secondary_separator=";;;")
    for epoch in range(12):   # a joined group is dropped whole or kept whole
        got = dropped.caption(dropped.base("a;;;b, c, d;;;e"), "k", epoch)
        assert ";;;" not in got
        assert "a,b" in got or ("a" not in got and "b" not in got)
        assert "d,e" in got or ("d" not in got and "e" not in got)


@pytest.mark.parametrize("sep", ["", ",", " , ", "|||", "a,b"])
def test_a_bad_secondary_separator_is_named(sep):
    from flame_models.data.config import validate_dataset_config
    cfg = DatasetConfig(folder_path="x", secondary_separator=sep, keep_tokens_separator="|||")
    assert any("secondary_separator" in m for m in validate_dataset_config(cfg, check_files=False))


def test_kohyas_wildcards_draw_one_option_per_epoch():
    """kohya's enable_wildcard: each "{a|b|c}" becomes one of its options, drawn per sample and epoch from the seed
    (the same on a rerun, samples apart), "{{" / "}}" literal braces; off, the text is kept as written."""
    from flame_models.data.captions import expand_wildcards
    r = rule(seed=3, enable_wildcard=True)
    base = r.base("a {red|green|blue} {ball|cube}, {{literal}}")
    assert base == "a {red|green|blue} {ball|cube}, {{literal}}"   # drawn per epoch: base keeps the text
    got = [r.caption(base, "k", e) for e in range(40)]
    colours = {c.split()[1] for c in got}
    assert colours == {"red", "green", "blue"} and {c.split()[2].rstrip(",") for c in got} == {"ball", "cube"}
    assert all(c.endswith(", {literal}") for c in got)
    assert got == [rule(seed=3, enable_wildcard=True).caption(base, "k", e) for e in range(40)]   # deterministic
    assert got != [r.caption(base, "other", e) for e in range(40)]                                # per sample
    assert got != [rule(seed=4, enable_wildcard=True).caption(base, "k", e) for e in range(40)]   # per seed
    assert set(r.variants_over(base, "k", range(40))) == set(got)                                 # all encoded
    off = rule()
    assert off.caption(off.base("a {red|blue} ball"), "k", 0) == "a {red|blue} ball"
    rng = np.random.default_rng(0)
    assert expand_wildcards("{only}", rng) == "only" and expand_wildcards("a {x|} b", rng) in ("a x b", "a  b")
    assert expand_wildcards("unpaired { brace", rng) == "unpaired { brace"
    assert expand_wildcards("{{a}} {{b|c}}", rng) == "{a} {b|c}" and expand_wildcards("x }}", rng) == "x }"


def test_multi_line_captions_first_random_or_all():
    """caption_lines: "all" keeps the file's text (ai-toolkit), "first" its first line (kohya), "random" one
    non-blank line per sample and epoch (kohya with enable_wildcard); prefix, suffix and trigger go on the line."""
    text = "a red ball\n\n  a round toy  \r\nsomething red"
    assert rule().caption(rule().base(text), "k", 0) == text
    first = rule(caption_lines="first", trigger="ohwx", caption_suffix="photo")
    assert first.caption(first.base(text), "k", 5) == "ohwx a red ball photo"
    r = rule(seed=1, caption_lines="random", trigger="ohwx", caption_prefix="pic:")
    base = r.base(text)
    got = {r.caption(base, "k", e) for e in range(30)}
    assert got == {"ohwx pic: a red ball", "ohwx pic: a round toy", "ohwx pic: something red"}
    assert set(r.variants_over(base, "k", range(30))) == got
    cyc = rule(seed=1, caption_lines="random", shuffle_variants=2)      # bounded like shuffled orders
    assert len(cyc.variants_over(cyc.base(text), "k", range(30))) <= 2
    # lines and wildcards together, then the tag rules on the drawn line
    both = rule(seed=2, caption_lines="random", enable_wildcard=True, shuffle_tokens=True, keep_tokens=1)
    b = both.base("ohwx, {red|blue}, ball\nohwx, {small|big}, cube")
    for e in range(20):
        tags = both.caption(b, "k", e).split(", ")
        assert tags[0] == "ohwx" and len(tags) == 3 and "{" not in "".join(tags)
    assert rule(caption_lines="random").caption(rule(caption_lines="random").base(""), "k", 0) == ""


def test_kohyas_caption_dropout_every_n_epochs():
    """In epochs N, 2N, ... counted from 1 (kohya's count: FLAME's epochs 2, 5, 8 for N = 3) every caption is the
    dropout caption, which is then among the variants encoded up front."""
    r = rule(trigger="ohwx", caption_dropout_every_n_epochs=3)
    base = r.base("a red ball")
    got = [r.caption(base, "k", e) for e in range(9)]
    assert [e for e, c in enumerate(got) if c == "ohwx"] == [2, 5, 8]
    assert set(r.variants_over(base, "k", range(9))) == {"ohwx a red ball", "ohwx"}
    assert r.variants_over(base, "k", [0, 1]) == ["ohwx a red ball"]
    assert r.variants_over(base, "k", [2]) == ["ohwx"]


@pytest.mark.parametrize("field, value, words", [
    ("caption_lines", "last", "caption_lines: one of all, first, random, got 'last'"),
    ("caption_dropout_every_n_epochs", -1, "caption_dropout_every_n_epochs: an integer >= 0"),
    ("caption_dropout_every_n_epochs", 1.5, "caption_dropout_every_n_epochs: an integer >= 0"),
    ("enable_wildcard", "yes", "enable_wildcard: expected true or false"),
])
def test_bad_line_wildcard_and_epoch_dropout_fields_are_named(field, value, words):
    from flame_models.data.config import validate_dataset_config
    cfg = DatasetConfig(folder_path="x", **{field: value})
    assert any(words in m for m in validate_dataset_config(cfg, check_files=False))


def test_a_dataset_with_wildcards_encodes_every_draw_and_previews_epoch_0(tmp_path):
    root = tmp_path / "d"
    write_caption(write_image(str(root / "a.png"), 64, 64), "a {red|blue} ball\na {tall|short} tower")
    cfg = DatasetConfig(folder_path=str(root), resolution=64, enable_wildcard=True, caption_lines="random")
    ds = ImageDataset([cfg], seed=5, progress=False)
    drawn = {ds.caption(0, e) for e in range(24)}
    assert drawn <= {"a red ball", "a blue ball", "a tall tower", "a short tower"} and len(drawn) >= 3
    assert set(ds.prompts(range(24))) == drawn
    assert ds.plain_caption(0) == ds.caption(0, 0)
