"""What a safetensors file holds, from its key names alone (checkpoint_io.describe_keys): used to turn "a LoRA given
as the model" into one line that says so, before any weight is read."""
import os

from flame_core import io

from ..checkpoint_io import describe_keys
from .family import ModelFileError


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
