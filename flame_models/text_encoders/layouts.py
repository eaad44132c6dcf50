"""Where a text encoder's tensors sit in a checkpoint, and how file keys map to the model's (transformers') keys.

Layouts (each under an optional prefix, e.g. `conditioner.embedders.0.transformer.` in SDXL checkpoints,
`text_encoders.clip_l.transformer.` in SD3 files):
    clip-hf        transformers 4.x / diffusers / ComfyUI clip_l, clip_g: `text_model.embeddings.token_embedding.weight`
    clip-flat      transformers 5.x CLIPTextModel files (and old SD1 files): the same without `text_model.`
    clip-openclip  OpenCLIP (SDXL's CLIP-G: `conditioner.embedders.1.model.`): `transformer.resblocks.N.attn.
                   in_proj_weight` (q | k | v rows), `positional_embedding`, `ln_final`, `text_projection` (in, out)
    t5             transformers / diffusers / ComfyUI t5xxl files: `encoder.block.N.layer.0.SelfAttention.q.weight`;
                   `shared.weight`, or its tied copy `encoder.embed_tokens.weight`

The other half of a whole model (a CLIPModel's vision tower, a T5 checkpoint's decoder and lm_head) is left out,
as transformers does when it loads the text encoder alone.

ComfyUI's scaled fp8 files (t5xxl_fp8_e4m3fn_scaled): their scale, input-scale and format keys never reach the key
map -- the checkpoint reader takes them out and applies the scales (checkpoint_io/scaled_fp8.py).
"""
from dataclasses import dataclass

from .configs import count_indexed

CLIP_HF_ANCHOR = "text_model.embeddings.token_embedding.weight"
CLIP_FLAT_ANCHOR = "embeddings.token_embedding.weight"
OPENCLIP_ANCHOR = "transformer.resblocks.0.attn.in_proj_weight"
T5_ANCHOR = "encoder.block.0.layer.0.SelfAttention.q.weight"


@dataclass(frozen=True)
class Candidate:
    """One text encoder found in a checkpoint: its layout, the prefix of its keys and its depth."""
    kind: str      # "clip" or "t5"
    layout: str    # clip-hf | clip-flat | clip-openclip | t5
    prefix: str
    layers: int

    def describe(self):
        what = {"clip-hf": "CLIP text model", "clip-flat": "CLIP text model (transformers 5 keys)",
                "clip-openclip": "OpenCLIP text model", "t5": "T5 encoder"}[self.layout]
        return f"{what} with {self.layers} layers under prefix {self.prefix!r}"


# (layout, kind, anchor, layer key head and tail): an encoder is found by a key ending in its anchor (the prefix is
# what comes before) and its depth counted from its layers' keys; the first layout whose anchor matches wins
# (clip-flat's anchor ends clip-hf's too)
_LAYOUTS = (
    ("clip-hf", "clip", CLIP_HF_ANCHOR, "text_model.encoder.layers.", ".mlp.fc1.weight"),
    ("clip-flat", "clip", CLIP_FLAT_ANCHOR, "encoder.layers.", ".mlp.fc1.weight"),
    ("clip-openclip", "clip", OPENCLIP_ANCHOR, "transformer.resblocks.", ".attn.in_proj_weight"),
    ("t5", "t5", T5_ANCHOR, "encoder.block.", ".layer.0.SelfAttention.q.weight"),
)


def find_encoders(keys):
    """Every text encoder in a checkpoint's key set, as Candidates (in the order of their keys)."""
    keys = set(keys)
    found = []
    for k in sorted(keys):
        for layout, kind, anchor, head, tail in _LAYOUTS:
            if not k.endswith(anchor):
                continue
            p = k[:-len(anchor)]
            # (an OpenCLIP vision tower has resblocks but no token embedding)
            if layout != "clip-openclip" or p + "token_embedding.weight" in keys:
                found.append(Candidate(kind, layout, p, count_indexed(keys, p + head, tail)))
            break
    return found


def looks_like(keys):
    """A few words on what a checkpoint holds, for errors when it is not the text encoder asked for."""
    keys = list(keys)
    enc = find_encoders(keys)
    if enc:
        return "; ".join(c.describe() for c in enc)
    ks = set(keys)

    def has(*parts):  # some key contains each part (not necessarily the same key)
        return all(any(p in k for k in ks) for p in parts)
    found = [what for what, hit in (
        ("a Flux transformer", has("double_blocks.", "single_blocks.") or has("transformer_blocks.", "x_embedder.")),
        ("an SD3 MMDiT", has("joint_blocks.")),
        ("a VAE", has("encoder.down.", "decoder.up.") or has("encoder.down_blocks.", "decoder.up_blocks.")
         or has("first_stage_model.")),
        ("a UNet", has("input_blocks.", "output_blocks.") or (has("down_blocks.", "resnets.", "attentions.")
                                                              and not has("encoder.down_blocks."))),
        ("a LoRA", has("lora_up") or has("lora_down") or has("lora_A") or has("lora_B"))) if hit]
    if found:
        return " and ".join(found)
    sample = ", ".join(sorted(ks)[:4])
    return f"nothing known ({len(ks)} tensors, e.g. {sample})"


# ----------------------------------------------------------------------------- file key -> model key
@dataclass(frozen=True)
class Source:
    """A model tensor's origin: file key (with prefix), and `transform`: None, "T" (transpose) or (i, n) (the i-th
    of n equal row blocks)."""
    key: str
    transform: object = None

    def shape(self, file_shape):
        s = tuple(file_shape)
        if self.transform == "T":
            return s[::-1]
        if isinstance(self.transform, tuple):
            i, n = self.transform
            return (s[0] // n,) + s[1:] if s and s[0] % n == 0 else ("not divisible by 3",) + s
        return s


_OPENCLIP_RESBLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                      "attn.out_proj": "self_attn.out_proj"}
_OPENCLIP_TOP = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                 "positional_embedding": "text_model.embeddings.position_embedding.weight",
                 "ln_final.weight": "text_model.final_layer_norm.weight",
                 "ln_final.bias": "text_model.final_layer_norm.bias"}
# keys that carry no weights of the text tower: buffers and the contrastive temperature
_IGNORED_SUFFIXES = ("position_ids", "logit_scale", "attn_mask")
# the other half of a whole model, which the text encoder does not use (as transformers' T5EncoderModel ignores a
# T5 checkpoint's decoder, and CLIPTextModel a CLIPModel's vision tower)
_OTHER_TOWER = {"clip-hf": ("vision_model.", "visual_projection."), "clip-flat": ("vision_model.",
                                                                                  "visual_projection."),
                "clip-openclip": ("visual.",), "t5": ("decoder.", "lm_head.")}


@dataclass
class KeyMap:
    sources: dict    # model key -> Source
    known: set       # file keys understood without being a model tensor (ignored buffers, tied duplicates)
    unknown: list    # file keys under the prefix this layout does not know


def map_keys(candidate, keys):
    """KeyMap of one Candidate over a checkpoint's keys (only keys under its prefix are considered)."""
    p = candidate.prefix
    local = sorted(k[len(p):] for k in keys if k.startswith(p))
    sources, known, unknown = {}, set(), []
    # a tied duplicate comes after the key it duplicates (T5's encoder.embed_tokens after shared)
    for k in sorted(local, key=lambda k: k == "encoder.embed_tokens.weight"):
        if p + k in known:
            continue
        if k.endswith(_IGNORED_SUFFIXES) or k.startswith(_OTHER_TOWER[candidate.layout]):
            known.add(p + k)
            continue
        targets = _model_keys(candidate.layout, k)
        if targets is None:
            unknown.append(p + k)
            continue
        for model_key, transform in targets:
            if model_key in sources:  # a tied duplicate (T5's encoder.embed_tokens beside shared)
                known.add(p + k)
                continue
            sources[model_key] = Source(p + k, transform)
    return KeyMap(sources, known, unknown)


def _model_keys(layout, k):
    """[(model key, transform)] that file key `k` (prefix removed) provides, or None when it is not understood."""
    if layout == "clip-hf":
        return [(k, None)] if k.startswith("text_model.") or k == "text_projection.weight" else None
    if layout == "clip-flat":
        if k.startswith(("embeddings.", "encoder.", "final_layer_norm.")):
            return [("text_model." + k, None)]
        return [(k, None)] if k == "text_projection.weight" else None
    if layout == "t5":
        if k == "encoder.embed_tokens.weight":
            return [("shared.weight", None)]
        return [(k, None)] if k == "shared.weight" or k.startswith("encoder.") else None
    # OpenCLIP
    if k in _OPENCLIP_TOP:
        return [(_OPENCLIP_TOP[k], None)]
    if k == "text_projection":
        return [("text_projection.weight", "T")]
    if k.startswith("transformer.resblocks."):
        rest = k[len("transformer.resblocks."):]
        idx, _, tail = rest.partition(".")
        if not idx.isdigit():
            return None
        layer = f"text_model.encoder.layers.{idx}."
        for name in ("weight", "bias"):
            if tail == f"attn.in_proj_{name}":
                return [(f"{layer}self_attn.{qkv}_proj.{name}", (i, 3)) for i, qkv in enumerate("qkv")]
        module, _, name = tail.rpartition(".")
        if module in _OPENCLIP_RESBLOCK and name in ("weight", "bias"):
            return [(f"{layer}{_OPENCLIP_RESBLOCK[module]}.{name}", None)]
    return None
