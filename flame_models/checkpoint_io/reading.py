"""The open safetensors files of one checkpoint, read one tensor at a time, and small helpers over key names."""
import os
import re

from flame_core.dtypes import dtype_of
from flame_core.io import safe_open

from .errors import CheckpointError
from .scaled_fp8 import ScaledWeights


class SafetensorsCheckpoint:
    """The safetensors files of one checkpoint, open (headers parsed, nothing read until `get`).

    `handle_of` maps each tensor name in the files to its open file; a name in two files is an error. The
    accessors take a model's key and read the tensor `source_key(key)` names: `prefix + key` here (the prefix is ''
    until a subclass finds where its model sits in the files); a subclass whose model names differ from the file's
    overrides `source_key`. A subclass reads its layout in `scan_keys`, called once the files are open (they are
    closed again if it raises). `error` is the CheckpointError subclass raised. Use it as a context manager.

    ComfyUI's scaled-fp8 files (scaled_fp8.py): the scales, input scales, format descriptions and marker are taken
    out of `handle_of` into `scaled` before `scan_keys` (checked there: a bad scale or format is named before any
    weight is read), and `get` returns such a weight dequantised (`stored * scale`); `dtype` still reports the
    stored float8 (the load's compute dtype follows from it, as for any fp8 file)."""

    error = CheckpointError
    layout = None          # a subclass's name for the key layout it found ("bfl", "diffusers", ...)
    config_source = None   # the file a subclass read the model's config from, if any

    def __init__(self, files, label=None):
        self.files = [os.fspath(f) for f in files]
        self.label = label if label is not None else ", ".join(self.files)
        self.prefix = ""
        self.handles, self.handle_of = [], {}
        try:
            for f in self.files:
                h = safe_open(f)
                self.handles.append(h)
                for k in h.keys():
                    if k in self.handle_of:
                        raise self.error(f"{self.label}: tensor {k!r} appears in two files, "
                                         f"{self.handle_of[k].filename} and {h.filename}")
                    self.handle_of[k] = h
            self.scaled = ScaledWeights.split(self.handle_of, self.label, self.error)
            self.scan_keys()
        except BaseException:
            self.close()
            raise

    def scan_keys(self):
        """Hook for subclasses: find the model's prefix / layout among `handle_of`'s keys."""

    def keys(self):
        """Every tensor name in the files (prefixes included)."""
        return self.handle_of.keys()

    def source_key(self, key):
        """The name in the files of the model's tensor `key`."""
        return self.prefix + key

    def has(self, key):
        return self.source_key(key) in self.handle_of

    def shape(self, key):
        sk = self.source_key(key)
        return tuple(self.handle_of[sk].shape(sk))

    def dtype(self, key):
        """The NumPy dtype stored (ml_dtypes for bfloat16 / float8)."""
        sk = self.source_key(key)
        return self.handle_of[sk].dtype(sk)

    def stored_dtype(self, key):
        """The flame dtype stored."""
        return dtype_of(self.dtype(key))

    def get(self, key, dtype=None, device=None):
        """The tensor, converted to `dtype` on `device` as it is read (a scaled fp8 weight: dequantised, in float32
        when `dtype` is None)."""
        sk = self.source_key(key)
        if sk in self.scaled.scale_of:
            return self.scaled.get(self.handle_of[sk], sk, dtype, device)
        return self.handle_of[sk].get_tensor(sk, dtype=dtype, device=device)

    def scale(self, key, device=None):
        """The scale of a scaled fp8 weight, one float32 per row ((rows,)), or None for any other tensor."""
        sk = self.source_key(key)
        return self.scaled.scale(sk, self.shape(key)[0], device) if sk in self.scaled.scale_of else None

    def get_stored(self, key, device=None):
        """The tensor as stored, a scaled fp8 weight without its scale (see `scale`)."""
        sk = self.source_key(key)
        return self.handle_of[sk].get_tensor(sk, device=device)

    def get_like(self, key, target):
        """The tensor in `target`'s dtype and on its device (a model's parameter, possibly a meta placeholder)."""
        return self.get(key, dtype=target.dtype, device=target.device)

    def metadata(self, name):
        """The value of `name` in the files' safetensors metadata (the first file that has it), or None."""
        for h in self.handles:
            value = (h.metadata() or {}).get(name)
            if value is not None:
                return value
        return None

    def describe(self):
        """The checkpoint for messages: "<label> (<layout> layout, prefix '...', config <file>)"."""
        return (f"{self.label} ({self.layout} layout" + (f", prefix {self.prefix!r}" if self.prefix else "")
                + (f", config {self.config_source}" if self.config_source else "") + ")")

    def close(self):
        for h in self.handles:
            h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- key names
def keys_under(keys, prefix):
    """The keys that start with `prefix`, prefix stripped (all keys when the prefix is ''): one model's tensors in
    a file that also holds others (a VAE's `first_stage_model.*` next to a UNet's `model.diffusion_model.*`)."""
    if prefix:
        return [k[len(prefix):] for k in keys if k.startswith(prefix)]
    return list(keys)


def block_indices(keys, prefix, suffix):
    """The sorted indices i of the keys `prefix` + i + `suffix` (e.g. "joint_blocks.", ".x_block.attn.qkv.weight")."""
    return tuple(sorted(int(k[len(prefix):-len(suffix)]) for k in keys if k.startswith(prefix)
                        and k.endswith(suffix) and k[len(prefix):-len(suffix)].isdigit()))


def count_indices(keys, pattern):
    """How many consecutive indices 0, 1, ... the regex `pattern` (one group, the index) finds among keys."""
    rx = re.compile(pattern)
    found = {int(m[1]) for k in keys for m in [rx.match(k)] if m}
    n = 0
    while n in found:
        n += 1
    return n


# (kind, words, fragments): the first row one of whose fragments is in some key name tells what a file holds.
# Adapters come first (their keys name the model they adapt), then the families' denoisers (registry.key_kinds: each
# family's about.py names its marks), then the parts whole checkpoints carry besides them -- SD3's bundled text
# encoders before the CLIP keys inside them.
ADAPTER_KINDS = (
    ("lora", "a LoRA / adapter file", ("lora_unet_", "lora_te", "lora_transformer_", ".lora_down.", ".lora_up.",
                                       ".lora_A.", ".lora_B.", ".lora_magnitude_vector", ".hada_w1_a", ".lokr_w1",
                                       ".lokr_w2")),
)
PART_KINDS = (
    ("transformer", "a diffusion transformer (diffusers layout)", ("context_embedder.",)),
    ("vae", "a VAE (autoencoder)", ("decoder.conv_in.", "encoder.conv_in.", "encoder.down.", "decoder.up.",
                                    "encoder.down_blocks.", "decoder.up_blocks.", "first_stage_model.")),
    ("text_encoders", "the text encoders of an SD3 checkpoint", ("text_encoders.",)),
    # (transformers 5 saves CLIPTextModel without the text_model. prefix; OpenCLIP names its layers resblocks)
    ("clip", "a CLIP text encoder", ("text_model.", "transformer.resblocks.", "encoder.layers.0.self_attn.q_proj.",
                                     "embeddings.token_embedding.", "text_projection")),
    ("t5", "a T5 text encoder", (".SelfAttention.", ".DenseReluDense.", "encoder.block.")),
)


def key_kinds():
    """[(kind, words, fragments)] in the order describe_keys tries them."""
    from .. import registry  # (lazy: the registry imports each family's about.py)
    return [*ADAPTER_KINDS, *registry.key_kinds(), *PART_KINDS]


def describe_keys(keys):
    """(kind, words, an example key) for a file's tensor names, from their names alone (no tensor read): kind is
    lora, a family's header_kind (flux, sd3, unet), transformer, vae, text_encoders, clip, t5 (key_kinds), or
    unknown ('an unknown model'; example None when there are no keys)."""
    keys = list(keys)
    for kind, words, fragments in key_kinds():
        for k in keys:
            if any(f in k for f in fragments):
                return kind, words, k
    return "unknown", "an unknown model", keys[0] if keys else None
