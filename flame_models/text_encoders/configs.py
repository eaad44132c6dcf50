"""Configs of the text encoders, with transformers' config.json field names, and what the weights alone tell.

    CLIPTextConfig.from_pretrained("text_encoder/")          # a folder (config.json), a config.json, or a dict
    T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100)   # a tiny one
    infer_clip_config(shapes) / infer_t5_config(shapes)      # from {transformers key: shape} of a single file

A single-file checkpoint (ComfyUI's clip_l / clip_g / t5xxl files, SDXL / SD3 checkpoints) carries no config. What
the shapes do not say is filled from the released models: CLIP's heads are 64 wide in every released text tower,
its activation is quick_gelu for the OpenAI widths (512, 768) and gelu for OpenCLIP's (1024 H, 1280 bigG), and the
EOS rule is the legacy argmax of the ids (`eos_token_id` 2, as the released config.json files say); T5's maximum
relative distance is 128 and its norm eps 1e-6 in every T5 release.
"""
import dataclasses
import json
import os

from flame_core.errors import FlameError


class TextEncoderConfigError(FlameError, ValueError):
    """A config that cannot describe a model (the message names the field), or a config the weights do not tell."""


def _read_json(source):
    if isinstance(source, dict):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise TextEncoderConfigError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise TextEncoderConfigError(f"{path}: not valid JSON ({e})") from None


class _ConfigMixin:
    @classmethod
    def from_dict(cls, d):
        """Fields of `d` that this config has (others, e.g. dropout or initializer settings, do not change the
        forward and are left out)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_pretrained(cls, source):
        """From a dict, a config.json, or a folder holding one."""
        return cls.from_dict(_read_json(source))

    def to_dict(self):
        return dataclasses.asdict(self)

    def _positive(self, *names):
        for n in names:
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise TextEncoderConfigError(f"{type(self).__name__}.{n} must be a positive int, got {v!r}")


# ----------------------------------------------------------------------------- CLIP
CLIP_ACTIVATIONS = ("quick_gelu", "gelu")


@dataclasses.dataclass
class CLIPTextConfig(_ConfigMixin):
    """transformers' CLIPTextConfig (the fields the text tower uses; defaults as transformers')."""
    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 49406
    eos_token_id: int = 49407

    def __post_init__(self):
        self._positive("vocab_size", "hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers",
                       "num_attention_heads", "max_position_embeddings")
        if self.hidden_size % self.num_attention_heads:
            raise TextEncoderConfigError(f"CLIPTextConfig: hidden_size {self.hidden_size} is not divisible by "
                                         f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in CLIP_ACTIVATIONS:
            raise TextEncoderConfigError(f"CLIPTextConfig.hidden_act must be one of {CLIP_ACTIVATIONS}, got "
                                         f"{self.hidden_act!r}")
        if self.eos_token_id is None:
            raise TextEncoderConfigError("CLIPTextConfig.eos_token_id is needed for the pooled output")

    @classmethod
    def from_dict(cls, d):
        if d.get("model_type") == "clip" and isinstance(d.get("text_config"), dict):
            d = d["text_config"]  # a whole CLIPModel's config: its text tower
        return super().from_dict(d)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


# the released text towers (as their config.json files say)
CLIP_PRESETS = {
    "clip-l": CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
                             num_hidden_layers=12, num_attention_heads=12, hidden_act="quick_gelu",
                             bos_token_id=0, eos_token_id=2, pad_token_id=1),
    "clip-g": CLIPTextConfig(vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280,
                             num_hidden_layers=32, num_attention_heads=20, hidden_act="gelu",
                             bos_token_id=0, eos_token_id=2, pad_token_id=1),
}


def infer_clip_config(shapes, *, source="the checkpoint"):
    """CLIPTextConfig from {transformers key: shape} (keys of CLIPTextModel[WithProjection], `text_model.` names)."""
    shape = _shape_reader(shapes, source, "CLIP")
    vocab, hidden = shape("text_model.embeddings.token_embedding.weight")
    max_pos = shape("text_model.embeddings.position_embedding.weight")[0]
    inter = shape("text_model.encoder.layers.0.mlp.fc1.weight")[0]
    layers = count_indexed(shapes, "text_model.encoder.layers.", ".mlp.fc1.weight")
    proj = shapes.get("text_projection.weight")
    if hidden % 64:
        raise TextEncoderConfigError(f"{source}: a CLIP text tower of width {hidden} is not a released one (heads are "
                                     f"64 wide in those); pass config=CLIPTextConfig(...) with its heads and "
                                     f"activation")
    act = {512: "quick_gelu", 768: "quick_gelu", 1024: "gelu", 1280: "gelu"}.get(hidden)
    if act is None:
        raise TextEncoderConfigError(f"{source}: the activation of a CLIP text tower of width {hidden} is not known "
                                     f"(quick_gelu for OpenAI's 512 / 768, gelu for OpenCLIP's 1024 / 1280); pass "
                                     f"config=CLIPTextConfig(...)")
    return CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                          projection_dim=proj[0] if proj is not None else hidden, num_hidden_layers=layers,
                          num_attention_heads=hidden // 64, max_position_embeddings=max_pos, hidden_act=act,
                          bos_token_id=0, eos_token_id=2, pad_token_id=1)


# ----------------------------------------------------------------------------- T5
T5_FEED_FORWARD = ("gated-gelu",)


@dataclasses.dataclass
class T5Config(_ConfigMixin):
    """transformers' T5Config, encoder fields. `feed_forward_proj` defaults to T5 v1.1's "gated-gelu" (transformers'
    default is the original T5's "relu", which this encoder does not implement)."""
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    def __post_init__(self):
        self._positive("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                       "relative_attention_num_buckets", "relative_attention_max_distance")
        if self.feed_forward_proj not in T5_FEED_FORWARD:
            raise TextEncoderConfigError(f"T5Config.feed_forward_proj {self.feed_forward_proj!r} is not supported: "
                                         f"this is the T5 v1.1 encoder ({', '.join(T5_FEED_FORWARD)})")
        if self.relative_attention_num_buckets < 4:
            raise TextEncoderConfigError(f"T5Config.relative_attention_num_buckets must be at least 4, got "
                                         f"{self.relative_attention_num_buckets}")

    @property
    def inner_dim(self):
        return self.d_kv * self.num_heads


T5_PRESETS = {
    "t5-xxl": T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
}


def infer_t5_config(shapes, *, source="the checkpoint"):
    """T5Config from {transformers key: shape} of a T5EncoderModel."""
    shape = _shape_reader(shapes, source, "T5")
    vocab, d_model = shape("shared.weight")
    inner = shape("encoder.block.0.layer.0.SelfAttention.q.weight")[0]
    buckets, heads = shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    if "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" not in shapes:
        raise TextEncoderConfigError(f"{source}: no gated feed-forward (DenseReluDense.wi_0 / wi_1): not a T5 v1.1 "
                                     f"encoder (the original T5's 'wi' is not supported)")
    d_ff = shape("encoder.block.0.layer.1.DenseReluDense.wi_0.weight")[0]
    if inner % heads:
        raise TextEncoderConfigError(f"{source}: attention width {inner} is not a multiple of the {heads} heads of "
                                     f"the relative attention bias")
    return T5Config(vocab_size=vocab, d_model=d_model, d_kv=inner // heads, d_ff=d_ff,
                    num_layers=count_indexed(shapes, "encoder.block.", ".layer.0.SelfAttention.q.weight"),
                    num_heads=heads, relative_attention_num_buckets=buckets)


def _shape_reader(shapes, source, model):
    """shape(key): the tuple shape of `key`, or a TextEncoderConfigError naming it when the weights lack it."""
    def shape(key):
        try:
            return tuple(shapes[key])
        except KeyError:
            raise TextEncoderConfigError(f"{source}: cannot infer the {model} config, {key!r} is missing") from None
    return shape


def count_indexed(keys, prefix, suffix):
    """How many consecutive indices i from 0 have `prefix + i + suffix` in `keys`."""
    n = 0
    while f"{prefix}{n}{suffix}" in keys:
        n += 1
    return n
