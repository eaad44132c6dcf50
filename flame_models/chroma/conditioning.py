"""Chroma prompt encoding: T5-XXL only, 512 tokens padded ("max_length"), run with the attention mask of the real
tokens plus the first padding token (as diffusers' ChromaPipeline and lodestone's reference); the tokenizer's mask
of the real tokens is kept beside the states -- the transformer attends those and the first padding token.

    with load_text_encoders(files, device="cuda") as enc:
        cond = enc.encode(["a photo of a cat"])     # prompt_embeds (1, 512, 4096), prompt_mask (1, 512)
"""
import numpy as np

import flame_core as flame

from ..conditioning.encoders import EncoderBundle, prompt_list
from ..text_encoders import load_t5
from ..tokenization import load_tokenizer
from .components import ChromaFilesError, part_files, read_headers

T5_QUANTIZE = (None, "fp8", "auto")


class ChromaTextEncoders(EncoderBundle):
    """T5 with its tokenizer. `encode(prompts)` -> {"prompt_embeds": (B, L, d_t5), "prompt_mask": (B, L) float32
    (1 on real tokens)}; `free()` (or leaving a `with` block) releases it."""

    encoder_attrs = ("t5",)
    tokenizer_attrs = ("t5_tokenizer",)

    def __init__(self, t5, t5_tokenizer, *, max_length):
        self.t5, self.t5_tokenizer = t5, t5_tokenizer
        self.max_length = int(max_length)
        self._start()

    def tokenize(self, prompts):
        """(ids (B, L) int64, mask (B, L) int64: 1 on the real tokens, the final </s> included)."""
        out = self.t5_tokenizer(prompt_list(prompts), max_length=self.max_length, padding="max_length",
                                truncation=True, return_attention_mask=True)
        return np.asarray(out.input_ids, np.int64), np.asarray(out.attention_mask, np.int64)

    def encode(self, prompts, *, batch_size=None):
        out = self._encode_batched(prompts, batch_size, self._encode_batch)
        return {"prompt_embeds": out["prompt_embeds"], "prompt_mask": out["pooled_prompt_embeds"]}

    def _encode_batch(self, prompts):
        ids, mask = self.tokenize(prompts)
        n = mask.sum(axis=1, keepdims=True)
        t5_mask = (np.arange(mask.shape[1])[None] <= n).astype(np.int64)    # + the first padding token
        states = self._run("t5")(ids, attention_mask=t5_mask).last_hidden_state.to(self.t5.dtype)
        return states, flame.tensor(mask.astype(np.float32), device=states.device)


def load_tokenizer_for(files, *, max_length=None):
    return load_tokenizer("t5", files.t5_tokenizer, max_length=files.t5_max_length if max_length is None
                          else int(max_length))


def check_vocabulary(files, tok):
    """Every id the tokenizer can produce has an embedding row in T5 (checked on the header)."""
    shapes = read_headers(part_files(files.t5, "t5"))
    rows = next((s[0] for k, s in shapes.items() if k.endswith(("shared.weight", "embed_tokens.weight"))), None)
    if rows is not None and tok.vocab_size > rows:
        raise ChromaFilesError(f"t5: the tokenizer ({tok.source}) has {tok.vocab_size} tokens but the encoder "
                               f"{files.t5} embeds only {rows}: pass the model's own tokenizer folder (--tokenizer)")


def load_text_encoders(files, *, dtype=flame.bfloat16, device=None, t5_quantize=None, t5_stream=False,
                       max_length=None):
    """T5 of `files` (ChromaFiles) with its tokenizer, frozen, in `dtype` on `device` (t5_quantize / t5_stream as
    Flux's: fp8 storage, blocks streamed from host memory)."""
    if t5_quantize not in T5_QUANTIZE:
        raise ValueError(f"t5_quantize must be None, 'fp8' or 'auto', got {t5_quantize!r}")
    tok = load_tokenizer_for(files, max_length=max_length)
    check_vocabulary(files, tok)
    t5 = load_t5(files.t5, dtype=dtype, device=device, quantize=t5_quantize, stream=bool(t5_stream))
    return ChromaTextEncoders(t5, tok, max_length=tok.model_max_length)
