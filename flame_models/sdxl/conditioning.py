"""SDXL prompt encoding, as diffusers' StableDiffusionXLPipeline.encode_prompt computes it:

    CLIP-L and CLIP-G: 77 tokens each (CLIP-L padded with EOS, CLIP-G with "!"), the penultimate hidden state (no
        final LayerNorm) of each, concatenated along channels -> prompt_embeds (77, 768 + 1280 = 2048);
    pooled_prompt_embeds = CLIP-G's text_embeds: its final-LayerNorm EOS state through the text projection (1280);
    the negative prompt: with negative_prompt None and force_zeros_for_empty_prompt (diffusers' default, True),
        zeros of those shapes; else the negative prompt ("" when None) encoded the same way;
    y (the UNet's vector input) = [pooled | the six size / crop embeddings] (flame_models.sdxl.make_y) from the
        original size, crop coordinates and target size (diffusers' add_time_ids; the negative gets the same sizes).

Long captions (max_token_length = 150, 225, ...): each CLIP in 75-token chunks, kohya sd-scripts' rule
(flame_models.conditioning.encoders); prompt_embeds then has 75 n + 2 tokens. prompt_weights=True reads ComfyUI's
"(text:1.2)" weights (flame_models.conditioning.prompt_weights); embeddings= textual inversions (A1111 / kohya SDXL
embedding files: flame_models.conditioning.embeddings).

    with load_text_encoders(files, dtype=flame.bfloat16, device="cuda") as enc:
        pe, npe, pooled, npooled = enc.encode_prompt(["a photo of a cat"], negative_prompt="blurry")
    y = make_y(pooled, original_size=(1024, 1024), crop_coords=(0, 0), target_size=(1024, 1024))
"""
import numpy as np

import flame_core as flame
from flame_core.errors import ShapeError

from ..conditioning import files as F
from ..conditioning import prompt_weights as PW
from ..conditioning.embeddings import TextualInversion, load_embedding
from ..conditioning.encoders import EncoderBundle, check_max_token_length, clip_ids, clip_states, prompt_list
from ..text_encoders import load_clip
from ..tokenization import load_tokenizer
from .components import SDXLFiles, SDXLFilesError, find_sdxl_files


class SDXLTextEncoders(EncoderBundle):
    """CLIP-L and CLIP-G (with its projection) and their tokenizers. `encode(prompts)` -> {"prompt_embeds":
    (B, 77, L + G), "pooled_prompt_embeds": (B, P)} in CLIP-G's dtype; `encode_prompt(...)` as diffusers' (with the
    negative prompt); `free()` (or leaving a `with` block) releases them."""

    encoder_attrs = ("clip_l", "clip_g")
    tokenizer_attrs = ("clip_l_tokenizer", "clip_g_tokenizer")

    def __init__(self, clip_l, clip_g, clip_l_tokenizer, clip_g_tokenizer, *, max_token_length=None,
                 force_zeros_for_empty_prompt=True, prompt_weights=False, embeddings=()):
        if getattr(clip_g, "text_projection", None) is None:
            raise ValueError("SDXLTextEncoders: clip_g needs its text projection (a CLIPTextModelWithProjection): "
                             "SDXL's pooled vector is CLIP-G's projected EOS state")
        self.clip_l, self.clip_g = clip_l, clip_g
        self.clip_l_tokenizer, self.clip_g_tokenizer = clip_l_tokenizer, clip_g_tokenizer
        self.max_token_length = check_max_token_length(max_token_length)
        self.force_zeros_for_empty_prompt = bool(force_zeros_for_empty_prompt)
        self.prompt_weights = bool(prompt_weights)
        self.tokens = {"clip_l": {}, "clip_g": {}}   # textual inversions: {token: ids} per CLIP
        for ti in embeddings:
            if ti.token in self.tokens["clip_l"]:
                raise ValueError(f"two embeddings have the token {ti.token!r}; name one apart (path:token)")
            for part in ("clip_l", "clip_g"):
                try:
                    self.tokens[part][ti.token] = getattr(self, part).add_token_vectors(ti.vectors[part])
                except ShapeError as e:
                    raise ValueError(f"embedding {ti.path or ti.token}: {part}: {e}") from None
        self._start()

    def tokenize(self, prompts):
        """(CLIP-L ids, CLIP-G ids), each (B * n, 77) int64 (n chunks per caption: 1 unless max_token_length)."""
        prompts = prompt_list(prompts)
        return (clip_ids(self.clip_l_tokenizer, prompts, self.max_token_length),
                clip_ids(self.clip_g_tokenizer, prompts, self.max_token_length))

    def encode(self, prompts, *, batch_size=None):
        """The SDXL conditioning of `prompts` (a str or a list of str), `batch_size` prompts at a time (default: all
        at once): {"prompt_embeds": (B, L, 2048), "pooled_prompt_embeds": (B, 1280)}."""
        return self._encode_batched(prompts, batch_size, self._encode_batch)

    def _encode_batch(self, batch):
        if self.prompt_weights or self.tokens["clip_l"]:
            (l_ids, l_w), (g_ids, g_w) = (
                PW.weighted_ids(tok, batch, self.max_token_length, parse_weights=self.prompt_weights,
                                embeddings=self.tokens[part])
                for tok, part in ((self.clip_l_tokenizer, "clip_l"), (self.clip_g_tokenizer, "clip_g")))
            weights = None if (l_w == 1).all() and (g_w == 1).all() else (l_w, g_w)
            return self.encode_ids(l_ids, g_ids, len(batch), graphed=True, weights=weights)
        l_ids, g_ids = self.tokenize(batch)
        return self.encode_ids(l_ids, g_ids, len(batch), graphed=True)

    def encode_ids(self, clip_l_ids, clip_g_ids, batch, *, graphed=False, weights=None):
        """(prompt_embeds (B, L, 2048), pooled_prompt_embeds (B, 1280)) of token ids from `tokenize` (B * n rows
        each, Tensors or arrays) for `batch` captions. graphed=False runs the encoders as modules, recording
        gradients when they are enabled (a trainer's adapters on them); graphed: replayed as CUDA graphs on cuda
        (inference only). weights: (CLIP-L's, CLIP-G's) per-token prompt weights of the ids (prompt_weights.py:
        weighted_ids), applied against the empty prompt's states; the pooled vector is the ids' own."""
        dtype = self.clip_g.dtype
        run = self._run if graphed else (lambda attr: getattr(self, attr))
        hl, _ = clip_states(run("clip_l"), self.clip_l, clip_l_ids, batch)
        hg, pg = clip_states(run("clip_g"), self.clip_g, clip_g_ids, batch)
        if weights is not None:
            el_ids, eg_ids = self.tokenize([""])
            hl = PW.apply_clip(run("clip_l"), self.clip_l, hl, el_ids, weights[0], batch)
            hg = PW.apply_clip(run("clip_g"), self.clip_g, hg, eg_ids, weights[1], batch)
        return flame.cat([hl.to(dtype), hg.to(dtype)], dim=-1), pg.to(dtype)

    def encode_negative(self, prompts, negative_prompt=None):
        """The negative conditioning for `prompts` (its batch size): zeros when negative_prompt is None and
        force_zeros_for_empty_prompt, else negative_prompt ("" when None; one str for all or one per prompt)."""
        prompts = prompt_list(prompts)
        if negative_prompt is None and self.force_zeros_for_empty_prompt:
            one = self.encode([""])
            return {k: flame.zeros(len(prompts), *v.shape[1:], dtype=v.dtype, device=v.device)
                    for k, v in one.items()}
        negative = "" if negative_prompt is None else negative_prompt
        negative = [negative] * len(prompts) if isinstance(negative, str) else prompt_list(negative,
                                                                                             "negative_prompt")
        if len(negative) != len(prompts):
            raise ValueError(f"negative_prompt has {len(negative)} entries for {len(prompts)} prompts")
        return self.encode(negative)

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True):
        """diffusers' (prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds, negative_pooled_prompt_embeds);
        without guidance the negatives are None."""
        cond = self.encode(prompt)
        if not do_classifier_free_guidance:
            return cond["prompt_embeds"], None, cond["pooled_prompt_embeds"], None
        neg = self.encode_negative(prompt, negative_prompt)
        return cond["prompt_embeds"], neg["prompt_embeds"], cond["pooled_prompt_embeds"], neg["pooled_prompt_embeds"]


def load_tokenizers(files):
    """(CLIP-L tokenizer, CLIP-G tokenizer) of `files` (their folders, else the packaged vocabulary)."""
    return load_tokenizer("clip_l", files.clip_l_tokenizer), load_tokenizer("clip_g", files.clip_g_tokenizer)


def check_vocabularies(files, clip_l_tok, clip_g_tok):
    """Every id a tokenizer can produce must have an embedding row in its encoder (checked on the headers)."""
    for part, tok in (("clip_l", clip_l_tok), ("clip_g", clip_g_tok)):
        path = getattr(files, part)
        shapes = F.read_headers(F.part_files(path, part, error=SDXLFilesError), error=SDXLFilesError)
        facts = F.clip_facts(shapes, files.prefixes.get(part, ""))
        F.check_vocabulary(part, tok, facts.get("vocab"), path, SDXLFilesError)


def load_text_encoders(files, *, dtype=flame.bfloat16, device=None, max_token_length=None,
                       force_zeros_for_empty_prompt=True, loras=(), prompt_weights=False, embeddings=()):
    """CLIP-L and CLIP-G of `files` (SDXLFiles or a path for find_sdxl_files) with their tokenizers, frozen, in
    `dtype` on `device`, as SDXLTextEncoders. loras: checked [(path, weight)] (pipeline.check_loras) whose
    text-encoder parts (kohya lora_te1_ / lora_te2_, diffusers text_encoder. / text_encoder_2.) are merged into
    CLIP-L / CLIP-G; files without them (the trainer's default, UNet-only) leave the encoders as they are.
    prompt_weights: read ComfyUI's "(text:1.2)" weights in the prompts (conditioning/prompt_weights.py).
    embeddings: textual inversions, "path[:token]" or TextualInversion (conditioning/embeddings.py), their vectors
    appended to both CLIPs' token tables."""
    files = files if isinstance(files, SDXLFiles) else find_sdxl_files(files)
    l_tok, g_tok = load_tokenizers(files)
    check_vocabularies(files, l_tok, g_tok)
    check_max_token_length(max_token_length)
    kw = dict(dtype=dtype, device=device, quantize=None)
    clip_l = load_clip(files.clip_l, prefix=files.prefixes.get("clip_l"), config=files.configs.get("clip_l"),
                       projection=False, **kw)
    clip_g = load_clip(files.clip_g, prefix=files.prefixes.get("clip_g"), config=files.configs.get("clip_g"),
                       projection=True, **kw)
    if loras:   # (a UNet-only file leaves the encoders as they are)
        from ..pipeline import apply_text_encoder_loras
        apply_text_encoder_loras(loras, [("te1", clip_l), ("te2", clip_g)], SDXLFilesError)
    widths = {"clip_l": clip_l.config.hidden_size, "clip_g": clip_g.config.hidden_size}
    embeddings = [e if isinstance(e, TextualInversion) else load_embedding(e, widths) for e in embeddings]
    return SDXLTextEncoders(clip_l, clip_g, l_tok, g_tok, max_token_length=max_token_length,
                            force_zeros_for_empty_prompt=force_zeros_for_empty_prompt, prompt_weights=prompt_weights,
                            embeddings=embeddings)


def encode_prompts(files, prompts, **kwargs):
    """Load the encoders, encode `prompts`, free the encoders: {key: NumPy float32 array} (host memory only)."""
    with load_text_encoders(files, **kwargs) as enc:
        out = enc.encode(prompts)
        return {k: np.asarray(v.float().numpy()) for k, v in out.items()}
