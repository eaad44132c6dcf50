"""Tokenizers of the diffusion models' text encoders: CLIP (L and G/bigG) and T5 v1.1.

    from flame_models.tokenization import load_tokenizer
    clip = load_tokenizer("clip_l", "FLUX.1-dev")            # model folder, tokenizer folder, or None (packaged)
    t5 = load_tokenizer("t5", "FLUX.1-dev", max_length=512)  # 256 for schnell
    ids = clip(["a photo of a cat"]).input_ids               # int64 (1, 77)

Built on `tokenizers` (and `sentencepiece` for folders that only have `spiece.model`), matching transformers'
CLIPTokenizer / T5Tokenizer on the same vocabulary files. vocab/NOTICE.md says where the packaged vocabularies come
from and under which licences.
"""
from .base import TextTokenizer
from .batch_encoding import BatchEncoding
from .clip import CLIPTokenizer
from .errors import TokenizerFilesError
from .load import KINDS, load_tokenizer
from .t5 import T5Tokenizer

__all__ = ["BatchEncoding", "CLIPTokenizer", "KINDS", "T5Tokenizer", "TextTokenizer", "TokenizerFilesError",
           "load_tokenizer"]
