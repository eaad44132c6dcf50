"""SD3 / SD3.5 prompt encoding, as diffusers' StableDiffusion3Pipeline.encode_prompt computes it:

    CLIP-L and CLIP-G: 77 tokens each (CLIP-L padded with EOS, CLIP-G with "!"), the penultimate hidden state
        (no final LayerNorm), concatenated along channels (77, 768 + 1280) and zero-padded to T5's width (4096);
    T5-XXL: 256 tokens (max_length), padded, no attention mask, the last hidden state -- appended along the sequence:
        prompt_embeds (77 + 256, 4096); without T5, zeros of that shape (as the references allow);
    pooled_prompt_embeds = [CLIP-L pooled | CLIP-G pooled] (768 + 1280): each encoder's `text_embeds` (its text
        projection of the final-LayerNorm EOS state) -- diffusers loads both as CLIPTextModelWithProjection --, or
        its unprojected `pooler_output` when the checkpoint has no text projection (SAI's and ComfyUI's CLIP-L).

    with load_text_encoders(files, dtype=flame.bfloat16, device="cuda") as enc:
        cond = enc.encode(["a photo of a cat"])          # prompt_embeds (1, 333, 4096), pooled (1, 2048)
        pe, npe, pooled, npooled = enc.encode_prompt("a cat", negative_prompt="blurry")
"""
import numpy as np

import flame_core as flame

from ..conditioning import files as F
from ..conditioning import prompt_weights as PW
from ..conditioning.encoders import EncoderBundle, check_max_token_length, clip_ids, clip_states, prompt_list
from ..text_encoders import load_clip, load_t5
from ..tokenization import load_tokenizer
from .components import T5_MAX_LENGTH, SD3Files, SD3FilesError, find_sd3_files

T5_QUANTIZE = (None, "fp8", "auto")


class SD3TextEncoders(EncoderBundle):
    """CLIP-L, CLIP-G and T5 (None: zeros of width `context_dim`) with their tokenizers. `encode(prompts)` ->
    {"prompt_embeds": (B, 77 + max_length, D), "pooled_prompt_embeds": (B, P_L + P_G)} in CLIP-L's dtype;
    `encode_prompt(...)` as diffusers' (with the negative prompt); `free()` (or leaving a `with` block) releases
    them. max_token_length: None (77 CLIP tokens, as diffusers) or 75 n for long captions in n chunks (see
    flame_models.conditioning.encoders; the CLIP part is then 75 n + 2 tokens)."""

    encoder_attrs = ("clip_l", "clip_g", "t5")
    tokenizer_attrs = ("clip_l_tokenizer", "clip_g_tokenizer", "t5_tokenizer")

    def __init__(self, clip_l, clip_g, t5, clip_l_tokenizer, clip_g_tokenizer, t5_tokenizer, *,
                 max_length=T5_MAX_LENGTH, context_dim=None, max_token_length=None, prompt_weights=False):
        self.clip_l, self.clip_g, self.t5 = clip_l, clip_g, t5
        self.clip_l_tokenizer, self.clip_g_tokenizer, self.t5_tokenizer = clip_l_tokenizer, clip_g_tokenizer, \
            t5_tokenizer
        self.max_length = int(max_length)
        self.max_token_length = check_max_token_length(max_token_length)
        self.prompt_weights = bool(prompt_weights)
        self.context_dim = t5.config.d_model if t5 is not None else context_dim
        if self.context_dim is None:
            raise ValueError("SD3TextEncoders without T5 need context_dim (the MMDiT's context width) for its zeros")
        width = clip_l.config.hidden_size + clip_g.config.hidden_size
        if width > self.context_dim:
            raise ValueError(f"SD3TextEncoders: CLIP widths {clip_l.config.hidden_size} + {clip_g.config.hidden_size} "
                             f"exceed the context width {self.context_dim}")
        self._start()

    def tokenize(self, prompts):
        """(CLIP-L ids (B*n, 77), CLIP-G ids (B*n, 77), T5 ids (B, max_length) or None) as int64 NumPy arrays,
        padded and truncated as diffusers does (n: chunks per caption, 1 by default)."""
        prompts = prompt_list(prompts)
        t5_ids = None
        if self.t5 is not None:
            t5_ids = self.t5_tokenizer(prompts, max_length=self.max_length, padding="max_length", truncation=True,
                                       return_attention_mask=False).input_ids
        return (clip_ids(self.clip_l_tokenizer, prompts, self.max_token_length),
                clip_ids(self.clip_g_tokenizer, prompts, self.max_token_length), t5_ids)

    def encode(self, prompts, *, batch_size=None):
        """The SD3 conditioning of `prompts` (a str or a list of str), `batch_size` prompts at a time (default: all
        at once). Returns {"prompt_embeds": (B, L, D), "pooled_prompt_embeds": (B, P)}."""
        return self._encode_batched(prompts, batch_size, self._encode_batch)

    def _weighted_tokenize(self, batch):
        """tokenize's ids of prompts in ComfyUI's weight syntax, with their per-token weights (None: all 1)."""
        (l_ids, l_w), (g_ids, g_w) = (PW.weighted_ids(tok, batch, self.max_token_length)
                                      for tok in (self.clip_l_tokenizer, self.clip_g_tokenizer))
        t5_ids = t5_w = None
        if self.t5 is not None:
            t5_ids, t5_w = PW.weighted_ids(self.t5_tokenizer, batch, length=self.max_length)
        if all(w is None or (w == 1).all() for w in (l_w, g_w, t5_w)):
            return (l_ids, g_ids, t5_ids), None
        return (l_ids, g_ids, t5_ids), (l_w, g_w, t5_w)

    def _encode_batch(self, batch):
        dtype = self.clip_l.dtype
        weights = None
        if self.prompt_weights:
            (l_ids, g_ids, t5_ids), weights = self._weighted_tokenize(batch)
        else:
            l_ids, g_ids, t5_ids = self.tokenize(batch)
        hl, pl = clip_states(self._run("clip_l"), self.clip_l, l_ids, len(batch))
        hg, pg = clip_states(self._run("clip_g"), self.clip_g, g_ids, len(batch))
        if weights is not None:   # each encoder's states against the empty prompt's (prompt_weights.py)
            el_ids, eg_ids, et_ids = self.tokenize([""])
            hl = PW.apply_clip(self._run("clip_l"), self.clip_l, hl, el_ids, weights[0], len(batch))
            hg = PW.apply_clip(self._run("clip_g"), self.clip_g, hg, eg_ids, weights[1], len(batch))
        clip = flame.cat([hl.to(dtype), hg.to(dtype)], dim=-1)                                # (B, 77, L + G)
        pad = self.context_dim - clip.shape[-1]
        if pad:
            clip = flame.cat([clip, flame.zeros(*clip.shape[:2], pad, dtype=dtype, device=clip.device)], dim=-1)
        if t5_ids is None:
            t5 = flame.zeros(len(batch), self.max_length, self.context_dim, dtype=dtype, device=clip.device)
        else:
            t5 = self._run("t5")(t5_ids).last_hidden_state
            if weights is not None:
                t5 = PW.apply(t5, self._run("t5")(et_ids).last_hidden_state, weights[2])
            t5 = t5.to(dtype)
        return (flame.cat([clip, t5], dim=1),                                                 # (B, 77 + T, D)
                flame.cat([pl.to(dtype), pg.to(dtype)], dim=-1))

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True):
        """diffusers' (prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds, negative_pooled_prompt_embeds).
        The negative prompt defaults to "" (one str for every prompt, or one per prompt); without guidance the
        negatives are None."""
        prompts = prompt_list(prompt)
        cond = self.encode(prompts)
        if not do_classifier_free_guidance:
            return cond["prompt_embeds"], None, cond["pooled_prompt_embeds"], None
        negative = "" if negative_prompt is None else negative_prompt
        negative = [negative] * len(prompts) if isinstance(negative, str) else prompt_list(negative,
                                                                                             "negative_prompt")
        if len(negative) != len(prompts):
            raise ValueError(f"negative_prompt has {len(negative)} entries for {len(prompts)} prompts")
        neg = self.encode(negative)
        return cond["prompt_embeds"], neg["prompt_embeds"], cond["pooled_prompt_embeds"], neg["pooled_prompt_embeds"]


def load_tokenizers(files, *, max_length=None):
    """(CLIP-L tokenizer, CLIP-G tokenizer, T5 tokenizer or None) of `files` (their folders, else the packaged
    vocabularies)."""
    t5 = None
    if files.t5 is not None:
        t5 = load_tokenizer("t5", files.t5_tokenizer, max_length=T5_MAX_LENGTH if max_length is None
                            else int(max_length))
    return load_tokenizer("clip_l", files.clip_l_tokenizer), load_tokenizer("clip_g", files.clip_g_tokenizer), t5


def check_vocabularies(files, clip_l_tok, clip_g_tok, t5_tok):
    """Every id a tokenizer can produce must have an embedding row in its encoder (checked on the headers)."""
    for part, tok in (("clip_l", clip_l_tok), ("clip_g", clip_g_tok), ("t5", t5_tok)):
        path = getattr(files, part)
        if tok is None or path is None:
            continue
        shapes = F.read_headers(F.part_files(path, part, error=SD3FilesError), error=SD3FilesError)
        prefix = files.prefixes.get(part, "")
        facts = F.t5_facts(shapes, prefix) if part == "t5" else F.clip_facts(shapes, prefix)
        F.check_vocabulary(part, tok, facts.get("vocab"), path, SD3FilesError)


def load_text_encoders(files, *, dtype=flame.bfloat16, device=None, t5=True, t5_quantize=None, t5_stream=False,
                       max_length=None, max_token_length=None, prompt_weights=False, loras=()):
    """CLIP-L, CLIP-G and T5 of `files` (SD3Files or a path for find_sd3_files) with their tokenizers, frozen, in
    `dtype` on `device`. t5=False (or a model without T5): zeros in T5's place. t5_quantize / t5_stream: as
    flux.conditioning.load_text_encoders (fp8 storage, blocks streamed from pinned host memory). max_length: T5
    tokens per prompt (256, diffusers' default). max_token_length: CLIP tokens in 75-token chunks (None: 77).
    prompt_weights: ComfyUI's "(text:1.2)" weights on all three encoders (conditioning/prompt_weights.py).
    loras: checked [(path, weight)] (pipeline.check_loras) whose text-encoder parts are applied -- CLIP-L's (kohya
    lora_te1_, diffusers text_encoder.), CLIP-G's (lora_te2_, text_encoder_2.), T5's (lora_te3_, text_encoder_3.;
    nothing to change without T5) -- merged into the weights (kept as adapters beside fp8 storage; refused for a
    streamed T5); files without them leave the encoders as they are."""
    files = files if isinstance(files, SD3Files) else find_sd3_files(files)
    if t5_quantize not in T5_QUANTIZE:
        raise ValueError(f"t5_quantize must be None, 'fp8' or 'auto', got {t5_quantize!r}")
    use_t5 = bool(t5) and files.t5 is not None
    if loras and use_t5 and t5_stream:
        from ..pipeline import refuse_streamed_encoder_loras
        refuse_streamed_encoder_loras(loras, ("te3",), "T5", SD3FilesError)
    l_tok, g_tok, t5_tok = load_tokenizers(files, max_length=max_length)
    t5_tok = t5_tok if use_t5 else None
    check_vocabularies(files, l_tok, g_tok, t5_tok)
    check_max_token_length(max_token_length)
    cfg = files.configs
    kw = dict(dtype=dtype, device=device, quantize=None)
    clip_l = load_clip(files.clip_l, prefix=files.prefixes.get("clip_l"), config=cfg.get("clip_l"), **kw)
    clip_g = load_clip(files.clip_g, prefix=files.prefixes.get("clip_g"), config=cfg.get("clip_g"), **kw)
    t5_model = None
    if use_t5:
        t5_model = load_t5(files.t5, dtype=dtype, device=device, prefix=files.prefixes.get("t5"),
                           config=cfg.get("t5"), quantize=t5_quantize, stream=bool(t5_stream))
    if loras:
        from ..pipeline import apply_text_encoder_loras
        apply_text_encoder_loras(loras, [("te1", clip_l), ("te2", clip_g), ("te3", t5_model)], SD3FilesError)
    return SD3TextEncoders(clip_l, clip_g, t5_model, l_tok, g_tok, t5_tok,
                           max_length=t5_tok.model_max_length if t5_tok is not None else
                           (T5_MAX_LENGTH if max_length is None else int(max_length)),
                           context_dim=files.params.context_in_dim if files.params is not None else None,
                           max_token_length=max_token_length, prompt_weights=prompt_weights)


def encode_prompts(files, prompts, **kwargs):
    """Load the encoders, encode `prompts`, free the encoders: {key: NumPy float32 array} (host memory only)."""
    with load_text_encoders(files, **kwargs) as enc:
        out = enc.encode(prompts)
        return {k: np.asarray(v.float().numpy()) for k, v in out.items()}
