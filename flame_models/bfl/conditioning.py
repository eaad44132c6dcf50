"""Flux prompt encoding: CLIP-L's pooled output and T5-XXL's last hidden state, as diffusers' FluxPipeline.encode_prompt
computes them (CLIP: 77 tokens padded with EOS, `pooler_output` unprojected; T5: 512 tokens for dev / 256 for schnell,
padded, no attention mask).

    with load_text_encoders(files, dtype=flame.bfloat16, device="cuda", t5_quantize="fp8") as enc:
        cond = enc.encode(["a photo of a cat"])      # prompt_embeds (1, 512, 4096), pooled_prompt_embeds (1, 768)
    # leaving the block frees both encoders (device and pinned host memory)
"""
import gc

import numpy as np

import flame_core as flame

from ..conditioning import prompt_weights as PW
from ..conditioning.encoders import EncoderBundle, prompt_list
from ..text_encoders import load_clip, load_t5
from ..tokenization import load_tokenizer
from .components import FluxFilesError, part_files, read_headers

T5_QUANTIZE = (None, "fp8", "auto")


class FluxTextEncoders(EncoderBundle):
    """CLIP-L + T5 with their tokenizers. `encode(prompts)` -> {"prompt_embeds": (B, L, d_t5),
    "pooled_prompt_embeds": (B, d_clip)} in the encoders' dtype; `free()` (or leaving a `with` block) releases them."""

    encoder_attrs = ("clip", "t5")
    tokenizer_attrs = ("clip_tokenizer", "t5_tokenizer")

    def __init__(self, clip, t5, clip_tokenizer, t5_tokenizer, *, max_length, prompt_weights=False):
        self.clip, self.t5 = clip, t5
        self.clip_tokenizer, self.t5_tokenizer = clip_tokenizer, t5_tokenizer
        self.max_length = int(max_length)
        self.prompt_weights = bool(prompt_weights)
        self._start()

    def tokenize(self, prompts):
        """(CLIP ids (B, 77), T5 ids (B, max_length)) as int64 NumPy arrays, padded and truncated as diffusers does."""
        prompts = prompt_list(prompts)
        clip_ids = self.clip_tokenizer(prompts, padding="max_length", truncation=True,
                                       return_attention_mask=False).input_ids
        t5_ids = self.t5_tokenizer(prompts, max_length=self.max_length, padding="max_length", truncation=True,
                                   return_attention_mask=False).input_ids
        return clip_ids, t5_ids

    def encode(self, prompts, *, batch_size=None):
        """The Flux conditioning of `prompts` (a str or a list of str), run `batch_size` prompts at a time
        (default: all at once). Returns {"prompt_embeds": (B, L, d_t5), "pooled_prompt_embeds": (B, d_clip)}."""
        return self._encode_batched(prompts, batch_size, self._encode_batch)

    def _encode_batch(self, prompts):
        if not self.prompt_weights:
            clip_ids, t5_ids = self.tokenize(prompts)
            weights = None
        else:   # ComfyUI's weights (prompt_weights.py) on T5's states; CLIP gives the pooled vector only
            clip_ids, _ = PW.weighted_ids(self.clip_tokenizer, prompt_list(prompts))
            t5_ids, weights = PW.weighted_ids(self.t5_tokenizer, prompt_list(prompts), length=self.max_length)
        pooled = self._run("clip")(clip_ids).pooler_output.to(self.clip.dtype)
        states = self._run("t5")(t5_ids).last_hidden_state
        if weights is not None and not (weights == 1).all():
            states = PW.apply(states, self._run("t5")(self.tokenize([""])[1]).last_hidden_state, weights)
        return states.to(self.t5.dtype), pooled


def load_tokenizers(files, *, max_length=None):
    """(CLIP-L tokenizer, T5 tokenizer) of `files` (their folders, else the packaged vocabularies)."""
    max_length = files.t5_max_length if max_length is None else int(max_length)
    clip_tok = load_tokenizer("clip_l", files.clip_tokenizer)
    t5_tok = load_tokenizer("t5", files.t5_tokenizer, max_length=max_length)
    return clip_tok, t5_tok


def check_vocabularies(files, clip_tok, t5_tok):
    """Every id a tokenizer can produce must have an embedding row in its encoder (a packaged vocabulary with a
    small model would otherwise fail mid-encoding): checked on the headers, before any weight is read."""
    for part, tok, suffixes in (("clip_l", clip_tok, ("token_embedding.weight",)),
                                ("t5", t5_tok, ("shared.weight", "embed_tokens.weight"))):
        path = getattr(files, part)
        shapes = read_headers(part_files(path, part))
        rows = next((s[0] for k, s in shapes.items() if k.endswith(suffixes)), None)
        if rows is not None and tok.vocab_size > rows:
            raise FluxFilesError(f"{part}: the tokenizer ({tok.source}) has {tok.vocab_size} tokens but the encoder "
                                 f"{path} embeds only {rows}: pass the model's own tokenizer folder (--tokenizer)")


def load_text_encoders(files, *, dtype=flame.bfloat16, device=None, t5_quantize=None, t5_stream=False,
                       max_length=None, prompt_weights=False, loras=()):
    """CLIP-L and T5 of `files` (FluxFiles) with their tokenizers, frozen, in `dtype` on `device`.

    t5_quantize: None (T5 in `dtype`; an fp8 file is dequantised), "fp8" (the block Linears in fp8 storage, a scale
    per row: about half the bytes) or "auto" (fp8 storage exactly when the file is fp8). t5_stream: T5's blocks in
    pinned host memory, streamed through the device (flame_nn.offload.BlockStreamer; `enc.t5.streamer`).
    max_length: T5 tokens per prompt, default 512 for flux-dev and 256 for schnell (files.t5_max_length).
    prompt_weights: ComfyUI's "(text:1.2)" weights on T5's states (conditioning/prompt_weights.py).
    loras: checked [(path, weight)] (check_loras) whose text-encoder parts are applied: CLIP-L's (kohya lora_te1_,
    diffusers text_encoder.) and T5's (kohya lora_te3_, diffusers text_encoder_2.), merged into the weights (kept as
    adapters beside fp8 storage; refused for a streamed T5); files without them leave the encoders as they are."""
    if t5_quantize not in T5_QUANTIZE:
        raise ValueError(f"t5_quantize must be None, 'fp8' or 'auto', got {t5_quantize!r}")
    if loras and t5_stream:
        from ..pipeline import refuse_streamed_encoder_loras
        refuse_streamed_encoder_loras(loras, ("te3", "te2"), "T5", FluxFilesError)
    clip_tok, t5_tok = load_tokenizers(files, max_length=max_length)
    check_vocabularies(files, clip_tok, t5_tok)
    clip = load_clip(files.clip_l, dtype=dtype, device=device, projection=False, quantize=None)
    t5 = None
    try:
        t5 = load_t5(files.t5, dtype=dtype, device=device, quantize=t5_quantize, stream=bool(t5_stream))
        if loras:
            from ..pipeline import apply_text_encoder_loras
            apply_text_encoder_loras(loras, [("te1", clip), (("te3", "te2"), t5)], FluxFilesError)
    except BaseException:
        del clip, t5
        gc.collect()
        raise
    return FluxTextEncoders(clip, t5, clip_tok, t5_tok, max_length=t5_tok.model_max_length,
                            prompt_weights=prompt_weights)


def encode_prompts(files, prompts, **kwargs):
    """Load the encoders, encode `prompts`, free the encoders: {key: NumPy float32 array} (host memory only)."""
    with load_text_encoders(files, **kwargs) as enc:
        out = enc.encode(prompts)
        return {k: np.asarray(v.float().numpy()) for k, v in out.items()}
