"""What the text encoders return: transformers' ModelOutput behaviour (attributes, keys, positions) and names.

    out = clip(input_ids, output_hidden_states=True)
    out.last_hidden_state is out["last_hidden_state"] is out[0]
    out.hidden_states[-2]                 # SDXL / SD3's penultimate layer
    tuple(out.keys())                     # only the fields that are set, in declaration order

Fields left at None are not keys and take no position (as transformers': `out[1]` is the next field that is set).
"""


class ModelOutput:
    """Base class: subclasses list their `fields`; unset ones stay None."""

    fields = ()

    def __init__(self, **values):
        unknown = set(values) - set(self.fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}; fields: {list(self.fields)}")
        for name in self.fields:
            object.__setattr__(self, name, values.get(name))

    def keys(self):
        return [k for k in self.fields if getattr(self, k) is not None]

    def values(self):
        return [getattr(self, k) for k in self.keys()]

    def items(self):
        return [(k, getattr(self, k)) for k in self.keys()]

    def to_tuple(self):
        return tuple(self.values())

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(f"{key!r} is not set in this {type(self).__name__} (set: {self.keys()})")
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key):
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())

    def __setattr__(self, name, value):
        if name not in self.fields:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        object.__setattr__(self, name, value)

    def __repr__(self):
        def show(v):
            if isinstance(v, tuple):
                return f"tuple of {len(v)}"
            return f"{tuple(v.shape)} {v.dtype}" if hasattr(v, "shape") else repr(v)
        return f"{type(self).__name__}(" + ", ".join(f"{k}={show(v)}" for k, v in self.items()) + ")"


class BaseModelOutput(ModelOutput):
    """T5EncoderModel: `last_hidden_state` (B, L, d_model) after the final norm; `hidden_states` when asked."""
    fields = ("last_hidden_state", "hidden_states")


class BaseModelOutputWithPooling(ModelOutput):
    """CLIPTextModel: `last_hidden_state` after the final LayerNorm, `pooler_output` (B, hidden) at the EOS token,
    `hidden_states` (embeddings, then each layer's output without the final LayerNorm) when asked."""
    fields = ("last_hidden_state", "pooler_output", "hidden_states")


class CLIPTextModelOutput(ModelOutput):
    """CLIPTextModelWithProjection: `text_embeds` = pooler_output @ text_projection, plus the fields of
    BaseModelOutputWithPooling (transformers' class leaves pooler_output out; SD3 needs it from CLIP-L)."""
    fields = ("text_embeds", "last_hidden_state", "pooler_output", "hidden_states")
