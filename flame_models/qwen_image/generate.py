"""Qwen-Image's part of `python -m flame_models.generate`. FLAME has the parts (the VAE, qwen_image/vae.py; the
Qwen2.5-VL language model, text_encoders/qwen2_5_vl.py; its tokenizer, tokenization/qwen2.py) but they are not wired
into generation's stages yet: a Qwen-Image model is recognised (its transformer's config is read and checked) and
the command stops with one message saying what is missing, before anything is loaded. The denoising loop itself
exists (flame_models.qwen_image.sampling: the pipeline's scheduler, CFG with a negative prompt and its norm rescale)
and is what the trainer's previews use."""
import os
from dataclasses import dataclass

from .. import generate as G
from .loading import QwenImageCheckpointError, read_qwen_image_params
from .params import QwenImageParams

_NOT_YET = "Qwen-Image generation is not available yet (its text-encoder and VAE stages are not wired)"
OPTIONS = {}            # none is taken while generation is refused (NOTES says why to an option's user)
NOTES = {"guidance": _NOT_YET, "cfg": _NOT_YET, "negative_prompt": _NOT_YET}


@dataclass
class QwenImageFiles:
    """Where a Qwen-Image model's transformer is, and its params (the VAE and text encoder are not supported yet)."""
    transformer: str
    params: QwenImageParams = None


FILES = QwenImageFiles


def generate(model, prompts, **_options):
    """Refuses, naming what is missing: Qwen-Image generation needs its text encoder and VAE (not in FLAME yet)."""
    files = model if isinstance(model, QwenImageFiles) else None
    if files is None:
        path = os.fspath(model)
        try:
            files = QwenImageFiles(path, read_qwen_image_params(path))
        except (QwenImageCheckpointError, KeyError, ValueError, OSError) as e:
            msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            msg = msg.splitlines()[0] if msg else type(e).__name__
            raise G.GenerateError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    raise G.GenerateError(f"{files.transformer}: Qwen-Image generation is not available yet: FLAME has its "
                          f"transformer, VAE, Qwen2.5-VL language model and tokenizer, but the stages are not "
                          f"wired together")
