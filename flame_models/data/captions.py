"""Caption rules, following ai-toolkit (toolkit/dataloader_mixins.py, toolkit/prompt_utils.py) and kohya.

- The caption of `a.png` is `a.<caption_ext>` (UTF-8, surrounding whitespace stripped); without one, the folder's
  `default_caption`; without that, the image is an error (DataError naming the files) - training on an empty
  caption by accident is worse than stopping. `caption_from: filename` takes the image's name instead ("_" read as
  spaces, SimpleTuner's filename captions), `caption_from: default_caption` gives every image default_caption
  (SimpleTuner's instanceprompt); neither reads a caption file.
- Trigger word (ai-toolkit's inject_trigger_into_prompt): `[trigger]` and `[name]` are replaced by it; a training
  caption that still lacks it gets it prepended ("ohwx " + caption). Sample prompts get the replacement only.
- Caption dropout: per sample and epoch, with probability `caption_dropout_rate`, the caption becomes the dropout
  caption - the trigger word alone when there is one, else "" (ai-toolkit injects the trigger into a dropped caption
  too). The draw is a pure function of (seed, epoch, sample), so a resumed run drops exactly the same captions.
- Tag shuffling (kohya's shuffle_caption + keep_tokens): split on `caption_separator`, strip, drop empty tags, keep
  the first `keep_tokens` in place, shuffle the rest, join with the separator plus a space. The order is a pure
  function of (seed, epoch or epoch mod shuffle_variants, sample). A prepended trigger word is part of the first
  tag ("ohwx a photo, red"), so `keep_tokens: 1` keeps it first.
- With the text encoder freed before training, every caption a run can draw must be encoded up front
  (ImageDataset.prompts(range(epochs))): one per image without tag shuffling, one per image and epoch with it
  (kohya refuses shuffle_caption with cached text outputs; ai-toolkit freezes one order at caching time).
  `shuffle_variants: K` bounds this to K orders per image, reused cyclically.
- kohya's caption_tag_dropout_rate: after shuffling, each tag outside the kept ones is dropped with this probability
  per sample and epoch (the same variants: one caption per image and epoch, or per K); keep_tokens_separator
  ("fixed ||| shuffled ||| fixed") keeps the first and last parts in place instead of keep_tokens; caption_prefix /
  caption_suffix are joined to the caption before the trigger word is placed.
- kohya's secondary_separator (";;;"): the tags it joins are one tag to shuffling and tag dropout (they are split on
  caption_separator only), and in the caption trained on it is replaced by caption_separator, as kohya does after
  shuffling ("a;;;b, c" trains as "a,b, c" or "c, a,b").
- Multi-line caption files (`caption_lines`): "all" trains on the whole text (ai-toolkit), "first" on its first line
  (kohya without enable_wildcard), "random" on one line per sample and epoch (kohya with it); lines are stripped and
  blank ones never drawn. kohya's enable_wildcard: each "{a|b|c}" becomes one of its options per sample and epoch
  ("{{" and "}}" are literal braces). Both draws come before caption_prefix / caption_suffix, the trigger word and
  the tag rules (kohya joins prefix and suffix to the whole file first, so its suffix reaches only the last line),
  from (seed, epoch or epoch mod shuffle_variants, sample): their variants are encoded up front as shuffled orders
  are. kohya's caption_dropout_every_n_epochs: in epochs N, 2N, ... (counted from 1 as kohya does) every caption is
  the dropout caption.
"""
import hashlib
import os
import re

import numpy as np

from .errors import DataError

TRIGGER_TOKENS = ("[trigger]", "[name]")


def filename_caption(path):
    """An image's caption from its file name (caption_from: filename): the name without its extension, each "_"
    read as a space, as SimpleTuner's caption_strategy filename reads it ("a_red_cube.png" -> "a red cube")."""
    return os.path.splitext(os.path.basename(path))[0].replace("_", " ").strip()


def read_caption(path):
    """The stripped UTF-8 text of a caption file; DataError naming it when it is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as ex:
        raise DataError(f"{path}: cannot read the caption file ({ex.strerror or ex})") from None
    try:
        text = data.decode("utf-8-sig")  # a BOM that Windows editors write is not part of the caption
    except UnicodeDecodeError as ex:
        raise DataError(f"{path}: the caption file is not UTF-8 (byte {ex.start}: {data[ex.start:ex.start + 1]!r});"
                        f" re-save it as UTF-8") from None
    return text.strip()


def caption_path(image_path, ext):
    return os.path.splitext(image_path)[0] + ext


class PreservationPrompt:
    """The prompt ai-toolkit's output preservation pairs a caption with: the caption with its dataset's trigger word
    replaced by the class `word` (differential output preservation; a caption without a trigger word as it is), or
    the empty prompt (blank prompt preservation: word None)."""

    def __init__(self, word=None):
        self.word = word

    def __call__(self, caption, trigger):
        if self.word is None:
            return ""
        return caption.replace(trigger, self.word) if trigger else caption


def apply_trigger(caption, trigger_word, add_if_missing=True):
    """`[trigger]`/`[name]` replaced by the trigger word (removed when there is none); with `add_if_missing`, the
    trigger word is prepended to a caption that does not contain it."""
    trigger = trigger_word or ""
    for token in TRIGGER_TOKENS:
        caption = caption.replace(token, trigger)
    if trigger.strip() and add_if_missing and trigger not in caption:
        caption = f"{trigger} {caption}"
    return caption.strip()


def split_tags(caption, separator=","):
    return [t.strip() for t in caption.split(separator) if t.strip()]


def join_tags(tags, separator=","):
    return (separator if separator.endswith(" ") else separator + " ").join(tags)


def _middle(tags, keep_tokens, keep_last):
    """(first, middle, last) of `tags`: the first keep_tokens and the last keep_last kept apart."""
    first = min(keep_tokens, len(tags))
    last = min(keep_last, len(tags) - first)
    return tags[:first], tags[first:len(tags) - last], tags[len(tags) - last:]


def shuffle_tags(caption, rng, keep_tokens=0, separator=",", keep_last=0):
    """The caption with its tags between the first `keep_tokens` and the last `keep_last` permuted by `rng` (a NumPy
    Generator)."""
    first, rest, last = _middle(split_tags(caption, separator), keep_tokens, keep_last)
    order = rng.permutation(len(rest))
    return join_tags(first + [rest[i] for i in order] + last, separator)


def drop_tags(caption, rng, rate, keep_tokens=0, separator=",", keep_last=0):
    """The caption without each of its tags between the first `keep_tokens` and the last `keep_last` that a draw of
    `rng` puts below `rate` (kohya's caption_tag_dropout_rate)."""
    first, rest, last = _middle(split_tags(caption, separator), keep_tokens, keep_last)
    draws = rng.random(len(rest))
    return join_tags(first + [t for t, d in zip(rest, draws) if d >= rate] + last, separator)


# one left-to-right pass: "{{" and "}}" (literal braces) or a wildcard "{...}" without braces inside
_WILDCARD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")


def caption_lines(text):
    """The stripped non-blank lines of a caption (any line ending)."""
    return [x.strip() for x in text.splitlines() if x.strip()]


def expand_wildcards(text, rng):
    """kohya's wildcards: each "{a|b|c}" replaced by one of its options drawn by `rng` (a NumPy Generator), left to
    right; "{{" and "}}" stand for literal braces; a brace without its pair stays as it is."""
    if "{" not in text and "}}" not in text:
        return text

    def pick(m):
        options = m.group(1)
        if options is None:
            return m.group(0)[0]
        options = options.split("|")
        return options[int(rng.integers(len(options)))]

    return _WILDCARD.sub(pick, text)


def stable_seed(*parts):
    """A 64-bit integer from strings/ints, the same on every machine and Python (unlike hash())."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


class CaptionRule:
    """How one dataset's captions vary over epochs (dropout, line and wildcard draws, tag shuffling) for a given
    training seed."""

    def __init__(self, cfg, seed, trigger_word=None):
        self.rate = float(cfg.caption_dropout_rate)
        self.every = int(getattr(cfg, "caption_dropout_every_n_epochs", 0) or 0)
        self.shuffle = bool(cfg.shuffle_tokens)
        self.keep_tokens = int(cfg.keep_tokens)
        self.separator = cfg.caption_separator
        self.variants = cfg.shuffle_variants
        self.seed = int(seed)
        self.trigger = cfg.trigger_word if cfg.trigger_word is not None else trigger_word
        self.dropout_caption = apply_trigger("", self.trigger)
        self.prefix = getattr(cfg, "caption_prefix", None)
        self.suffix = getattr(cfg, "caption_suffix", None)
        self.keep_separator = getattr(cfg, "keep_tokens_separator", None)
        self.secondary = getattr(cfg, "secondary_separator", None)
        self.tag_rate = float(getattr(cfg, "caption_tag_dropout_rate", 0.0) or 0.0)
        self.lines = getattr(cfg, "caption_lines", "all") or "all"
        self.wildcard = bool(getattr(cfg, "enable_wildcard", False))
        # whether a caption's text is drawn per epoch (a random line, wildcards): base() then keeps the file's text
        # and each draw is finished (prefix, suffix, trigger) on its own
        self.drawn = self.wildcard or self.lines == "random"
        self._kept = {}   # base caption -> (tags kept first, tags kept last) where keep_tokens_separator split it

    def base(self, raw_caption):
        """The caption before per-epoch changes: its first line under caption_lines "first"; then (unless a line or
        wildcard is drawn per epoch: then the text as it is) kohya's caption_prefix / caption_suffix joined with a
        space, and the trigger substituted, or prepended when missing."""
        if self.lines == "first":
            lines = caption_lines(raw_caption)
            raw_caption = lines[0] if lines else ""
        if self.drawn:
            return raw_caption
        caption, kept = self._finish(raw_caption)
        if kept is not None:
            self._kept[caption] = kept
        return caption

    def _finish(self, text):
        """(caption, kept): prefix, suffix and trigger placed; kohya's keep_tokens_separator parts joined, `kept`
        then (tags kept first, tags kept last), else None."""
        if self.prefix:
            text = f"{self.prefix} {text}"
        if self.suffix:
            text = f"{text} {self.suffix}"
        caption = apply_trigger(text, self.trigger)
        if self.keep_separator and self.keep_separator in caption:
            # kohya's keep_tokens_separator: "fixed ||| shuffled [||| fixed at the end]", written without it
            parts = [split_tags(x, self.separator) for x in caption.split(self.keep_separator, 2)]
            parts += [[]] * (3 - len(parts))
            return join_tags(parts[0] + parts[1] + parts[2], self.separator), (len(parts[0]), len(parts[2]))
        return caption, None

    def _draw(self, base_caption, key, variant):
        """(caption, kept) of a drawn rule in `variant`: a random line (caption_lines "random"), its wildcards
        expanded, then finished as base() finishes a fixed caption."""
        rng = np.random.default_rng([stable_seed("lines", key), self.seed, variant])
        text = base_caption
        if self.lines == "random":
            lines = caption_lines(text)
            text = lines[int(rng.integers(len(lines)))] if lines else ""
        if self.wildcard:
            text = expand_wildcards(text, rng)
        return self._finish(text)

    def dropped(self, key, epoch):
        """Whether the sample named `key` (a stable string) loses its caption in `epoch` (counted from 0)."""
        if self._all_dropped(epoch):
            return True
        if self.rate <= 0:
            return False
        if self.rate >= 1:
            return True
        return np.random.default_rng([stable_seed("dropout", key), self.seed, epoch]).random() < self.rate

    def _all_dropped(self, epoch):
        """kohya's caption_dropout_every_n_epochs: every caption dropped in epochs N, 2N, ... (counted from 1)."""
        return bool(self.every) and (epoch + 1) % self.every == 0

    def caption(self, base_caption, key, epoch, shuffle_key=None):
        """The caption the sample named `key` trains with in `epoch`; its draws (tag order, line, wildcards) come from
        `shuffle_key` (default `key`): samples sharing one (the same image at several resolutions) share them."""
        if self.dropped(key, epoch):
            return self.dropout_caption
        return self.shuffled(base_caption, key if shuffle_key is None else shuffle_key, epoch)

    def plain(self, base_caption, key):
        """The caption without dropout, shuffling or tag dropout (a preview prompt): epoch 0's line and wildcard
        draws, kohya's secondary_separator replaced."""
        return self.joined(self._draw(base_caption, key, 0)[0] if self.drawn else base_caption)

    def shuffled(self, base_caption, key, epoch):
        """The caption's text in `epoch`: its drawn line and wildcards (when drawn), then the tags but the kept ones
        (the first keep_tokens, or keep_tokens_separator's first and last parts) shuffled (shuffle_tokens), then
        each of those dropped with probability caption_tag_dropout_rate (kohya's order); the draws a pure function
        of (seed, variant, key)."""
        variant = epoch if self.variants is None else epoch % self.variants
        if self.drawn:
            caption, kept = self._draw(base_caption, key, variant)
        else:
            caption, kept = base_caption, self._kept.get(base_caption)
        if not (self.shuffle or self.tag_rate):
            return self.joined(caption)
        first, last = kept if kept is not None else (self.keep_tokens, 0)
        if self.shuffle:
            rng = np.random.default_rng([stable_seed("shuffle", key), self.seed, variant])
            caption = shuffle_tags(caption, rng, first, self.separator, last)
        if self.tag_rate:
            rng = np.random.default_rng([stable_seed("tags", key), self.seed, variant])
            caption = drop_tags(caption, rng, self.tag_rate, first, self.separator, last)
        return self.joined(caption)

    def joined(self, caption):
        """kohya's secondary_separator replaced by caption_separator (after shuffling and tag dropout)."""
        return caption.replace(self.secondary, self.separator) if self.secondary else caption

    def variants_over(self, base_caption, shuffle_key, epochs):
        """Every caption a sample can draw in `epochs` (epoch numbers), without repeats: its drawn texts and tag
        orders for those epochs (or just its caption), plus the dropout caption when some epoch drops it."""
        kept = [e for e in epochs if not self._all_dropped(e)]
        if self.rate >= 1 or not kept:
            out = []
        elif self.shuffle or self.tag_rate or self.drawn:
            seen = sorted({e if self.variants is None else e % self.variants for e in kept})
            out = list(dict.fromkeys(self.shuffled(base_caption, shuffle_key, v) for v in seen))
        else:
            out = [self.joined(base_caption)]
        if (self.rate > 0 or len(kept) < len(epochs)) and self.dropout_caption not in out:
            out.append(self.dropout_caption)
        return out
