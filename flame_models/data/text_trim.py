"""The text tokens a run's attention never sees, cut from every batch (exact: sd-scripts trims Chroma's T5 so).

Families whose text is padded to a fixed length and masked (Chroma's T5: the real tokens and the first padding token
are attended; Qwen-Image: the valid tokens) attend only a prefix of each caption's tokens. A padded key that every
query is masked from never reaches an output, and a padded query's row only feeds its own (masked) token, so
cutting the text after the longest attended prefix of the run gives the same image outputs with fewer tokens. The
cut length is one for the whole run (the longest caption's prefix), so every batch keeps one shape and a CUDA graph
per bucket still covers the run. When every caption's prefix has that length, nothing is left to mask: the batches
carry no mask at all (the attention's unmasked path).

    trim = TextTrim()                               # shared by the training views and the validation data
    trim.plan([32, 129, 77], full_length=512)       # -> 129 tokens, masks kept (the prefixes differ)
    item = trim.apply(item)                          # prompt_embeds (512, D) -> (129, D), prompt_mask (129,)
"""
import numpy as np

from .errors import DataError

TEXT_KEY, MASK_KEY = "prompt_embeds", "prompt_mask"


def valid_tokens(prompt_mask):
    """The tokens a family's training reads as valid, from cached prompt_mask rows (..., L): > 0.5, and a row
    without any all valid (a synthetic sample's arrays are noise)."""
    m = np.asarray(prompt_mask) > 0.5
    return np.where(m.any(axis=-1, keepdims=True), m, True)


def batch_text_mask(batch):
    """A batch's prompt_mask as the model takes it -- float32 (B, L), valid_tokens -- or None when the batch has
    none (the run's text was cut to what every caption attends: nothing left to mask)."""
    return None if MASK_KEY not in batch else valid_tokens(batch[MASK_KEY]).astype(np.float32)


class TextTrim:
    """length: the text tokens kept (None: no cut); keep_mask: whether the batches still carry prompt_mask."""

    def __init__(self):
        self.length, self.keep_mask, self.full_length = None, True, None

    def plan(self, prefixes, full_length):
        """Cut to the longest of the attended `prefixes` (one per caption, each <= full_length); returns the
        length, or None when nothing would be cut."""
        prefixes = [int(p) for p in prefixes]
        if not prefixes or any(not 0 < p <= full_length for p in prefixes):
            raise DataError(f"TextTrim.plan: attended prefixes must be in [1, {full_length}], got "
                            f"{sorted(set(prefixes))[:8]}")
        n = max(prefixes)
        uniform = all(p == n for p in prefixes)
        if n == full_length and not uniform:
            self.length, self.keep_mask, self.full_length = None, True, full_length
            return None
        self.length, self.keep_mask, self.full_length = n, not uniform, full_length
        return n

    @property
    def active(self):
        return self.length is not None

    def apply(self, item):
        """`item` (one sample's arrays by name) with its text cut to `length` (and its mask dropped when every
        caption attends all of it)."""
        if self.length is None:
            return item
        txt, mask = item.get(TEXT_KEY), item.get(MASK_KEY)
        if txt is None or mask is None or np.shape(txt)[0] != self.full_length or np.shape(mask) != (self.full_length,):
            raise DataError(f"text trim: expected {TEXT_KEY} ({self.full_length}, D) and {MASK_KEY} "
                            f"({self.full_length},), got {None if txt is None else tuple(np.shape(txt))} and "
                            f"{None if mask is None else tuple(np.shape(mask))}")
        out = dict(item)
        out[TEXT_KEY] = txt[:self.length]
        if self.keep_mask:
            out[MASK_KEY] = mask[:self.length]
        else:
            del out[MASK_KEY]
        return out

    def describe(self):
        if self.length is None:
            return "text: no token cut"
        return (f"text: {self.full_length} -> {self.length} tokens (the rest are masked from every attention), "
                + ("masks kept (captions differ in length)" if self.keep_mask else "no mask left"))
