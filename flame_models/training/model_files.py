"""What a safetensors file holds, from its key names alone: a Flux / SD3 transformer, a UNet, a VAE, a CLIP or T5
text encoder, a LoRA, or unknown. Used to turn "a LoRA given as the model" into one line that says so, before any
weight is read."""
import os

from flame_core import io

from .family import ModelFileError

# (kind, words, key suffixes or fragments that identify it); the first match wins, so adapters come before models,
# and the families' denoisers (registry.key_kinds) before the parts they share
_ADAPTERS = (
    ("lora", "a LoRA / adapter file", (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight",
                                        ".lora_magnitude_vector", ".hada_w1_a", ".lokr_w1", ".lokr_w2")),
)
_PARTS = (
    ("vae", "a VAE (autoencoder)", ("decoder.conv_in.weight", "encoder.conv_in.weight")),
    # (transformers 5 saves CLIPTextModel without the text_model. prefix)
    ("clip", "a CLIP text encoder", ("encoder.layers.0.self_attn.q_proj.weight", "embeddings.token_embedding.weight")),
    ("t5", "a T5 text encoder", ("encoder.block.0.layer.0.SelfAttention.q.weight",)),
)


def describe_keys(keys):
    """(kind, words, an example key) for a file's tensor names; kind is one of lora, a family's header_kind (flux,
    sd3, unet), vae, clip, t5, unknown."""
    from .. import registry
    keys = list(keys)
    for kind, words, marks in (*_ADAPTERS, *registry.key_kinds(), *_PARTS):
        for k in keys:
            if k.endswith(marks):
                return kind, words, k
    return "unknown", "an unknown model", keys[0] if keys else None


def file_keys(path):
    """The tensor names of one safetensors file (its header only). ModelFileError when it is not readable."""
    try:
        with io.safe_open(path) as f:
            return list(f.keys())
    except Exception as e:  # any unreadable header: a truncated download, an HTML error page, a .ckpt
        raise ModelFileError(f"{path}: not a readable .safetensors file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None


def describe_file(path):
    """One phrase for what the safetensors file `path` looks like, e.g. "a LoRA / adapter file (keys such as
    lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight)"."""
    if os.path.isdir(path):
        return "a folder"
    kind, words, key = describe_keys(file_keys(path))
    return words + (f" (keys such as {key})" if key else " (no tensors)")
