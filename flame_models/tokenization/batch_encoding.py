"""BatchEncoding: what a tokenizer call returns (transformers' name and access patterns)."""


class BatchEncoding(dict):
    """A dict of `input_ids` (and `attention_mask` when asked) that also reads as attributes:
    `enc["input_ids"]` and `enc.input_ids` are the same (B, L) int64 array (or list of lists)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"BatchEncoding has no {name!r}; it holds {sorted(self)}") from None
