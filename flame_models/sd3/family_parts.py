"""The parts of an SD3 / SD3.5 run besides the MMDiT -- the VAE, CLIP-L, CLIP-G, T5 (optional) and their tokenizers --
for image folders and text prompts: found from the config's files (flame_models.sd3.components.find_sd3_files), or
built with random weights at the sizes of `model.size`.

Files: model.name_or_path a diffusers folder (transformer/, vae/, text_encoder/ .. text_encoder_3/, tokenizer/ ..
tokenizer_3/), an SAI single file holding the parts (first_stage_model., text_encoders.clip_l/clip_g/t5xxl.), or an
MMDiT file with model.vae_path / clip_l_path / clip_g_path / t5_path (ComfyUI's separate files; tokenizers:
model.tokenizer_path, else the folder's, else the vocabularies packaged with FLAME). model.use_t5 false (or a model
without T5) encodes T5's tokens as zeros, as the references allow. Only headers are read before the stages run.

Random parts (model.size, no name_or_path): sd3.5-large / -large-turbo / -medium: the SD3 VAE, CLIP-L, CLIP-G and
T5-XXL at their released sizes with random weights drawn on the device, the packaged tokenizers; sd3.5-tiny: the
analytic pooling VAE with 16 latent channels, 2-layer CLIPs (12 and 16 wide, projections 8 + 8 = the pooled 16) and
a T5 32 wide (the preset's context width), tokenizers learned from the tiny corpus.

Memory: T5 in fp8 when model.quantize_te asks or max_gpu_memory cannot hold it in bfloat16, streamed when even fp8
does not fit (sd_parts.t5_storage).
"""
import functools

import flame_core as flame
import flame_nn

from ..training import family_parts as S
from .components import SUBFOLDERS, T5_MAX_LENGTH, find_sd3_files
from .conditioning import SD3TextEncoders, check_vocabularies, load_text_encoders, load_tokenizers
from .params import sd3_params
from .pipeline import load_vae_for_sd3

PATH_FIELDS = ("vae_path", "clip_l_path", "clip_g_path", "t5_path", "tokenizer_path")
WHAT = "SD3 model"
TINY = "sd3.5-tiny"


def sd3_files(model_cfg):
    """SD3Files of the config's model and parts (headers read); SD3FilesError listing every problem."""
    m = model_cfg
    return find_sd3_files(m.name_or_path, clip_l=m.clip_l_path, clip_g=m.clip_g_path, t5=m.t5_path, vae=m.vae_path,
                          tokenizer=m.tokenizer_path)


def _size(model_cfg):
    return model_cfg.size or TINY


def problems(cfg, *, vae, text, prefix=""):
    """sd_parts.problems of an SD3 model's parts (CLIP-L, CLIP-G, T5), noting a T5 file given with use_t5 false."""
    m = cfg.model
    unused_t5 = not m.use_t5 and m.t5_path is not None
    notes = [f"{prefix}model.t5_path: not used: model.use_t5 is false"] if unused_t5 else []
    return S.problems(m, sd3_files, "transformer", ("clip_l", "clip_g", "t5"), WHAT, _size(m), PATH_FIELDS, vae=vae,
                      text=text, prefix=prefix, notes=notes,
                      vocabularies=lambda files: check_vocabularies(files, *_tokenizers(files, m)))


def _tokenizers(files, model_cfg):
    l_tok, g_tok, t5_tok = load_tokenizers(files, max_length=t5_max_length(model_cfg))
    return l_tok, g_tok, t5_tok if model_cfg.use_t5 else None


def t5_max_length(model_cfg):
    """T5 tokens per caption: model.t5_max_length, else diffusers' 256."""
    return model_cfg.t5_max_length or T5_MAX_LENGTH


# ----------------------------------------------------------------------------- the VAE
def vae_id(model_cfg, device):
    return S.vae_id("sd3", model_cfg, _size(model_cfg), device,
                    lambda: S.part_identity(sd3_files(model_cfg), "vae", SUBFOLDERS))


def load_vae(model_cfg, device):
    return S.load_vae("sd3", model_cfg, _size(model_cfg) == TINY, 16, device, load_vae_for_sd3, sd3_files)


# ----------------------------------------------------------------------------- the text encoders
def _t5_params(model_cfg):
    if model_cfg.name_or_path is None:
        from ..text_encoders import T5_PRESETS
        return 0 if _size(model_cfg) == TINY else S.t5_params_count(T5_PRESETS["t5-xxl"])
    f = sd3_files(model_cfg)
    if f.t5 is None or not model_cfg.use_t5:
        return 0
    return S.parameter_count(f.t5, "t5", f.prefixes.get("t5", ""), SUBFOLDERS)


@functools.lru_cache(maxsize=None)
def _released_clip_params():
    from ..text_encoders import CLIPTextModelWithProjection
    n = 0
    for kind in ("clip_l", "clip_g"):
        with flame_nn.empty_init(device="cpu"):   # shapes only
            n += sum(p.numel() for p in CLIPTextModelWithProjection(S.released_clip(kind)[0]).parameters())
    return n


def _clip_params(model_cfg):
    """CLIP-L + CLIP-G parameters (held beside T5 while captions are encoded)."""
    if model_cfg.name_or_path is None:
        return 0 if _size(model_cfg) == TINY else _released_clip_params()
    f = sd3_files(model_cfg)
    return sum(S.parameter_count(getattr(f, k), k, f.prefixes.get(k, ""), SUBFOLDERS) for k in ("clip_l", "clip_g"))


def t5_storage(model_cfg, device, budget):
    """How T5 is held while captions are encoded ('none' without it): see sd_parts.t5_storage."""
    if not model_cfg.use_t5:
        return "none"
    if model_cfg.name_or_path is not None and sd3_files(model_cfg).t5 is None:
        return "none"
    return S.t5_storage(lambda: _t5_params(model_cfg), model_cfg.quantize_te, device, budget,
                        beside=lambda: _clip_params(model_cfg))


def text_id(model_cfg, device, budget):
    m = model_cfg

    def files_key():
        f = sd3_files(m)
        parts = [S.part_identity(f, k, SUBFOLDERS) for k in ("clip_l", "clip_g")]
        if f.t5 is not None and m.use_t5:
            parts.append(S.part_identity(f, "t5", SUBFOLDERS))
        return f"{'|'.join(parts)}|tok:{f.clip_l_tokenizer}:{f.clip_g_tokenizer}:{f.t5_tokenizer}"
    how = f"{S.te_dtype(device)}|t5:{t5_storage(m, device, budget)}:{t5_max_length(m)}"
    return S.cache_id("sd3-te", m, _size(m), how, files_key)


def describe(model_cfg, device, budget):
    how = t5_storage(model_cfg, device, budget)
    t5 = "no T5 (its tokens are zeros)" if how == "none" else f"T5 ({how}, {t5_max_length(model_cfg)} tokens)"
    return f"CLIP-L + CLIP-G + {t5}"


def load_text_encoders_for(model_cfg, device, budget=None):
    """SD3TextEncoders (encode(prompts) -> {prompt_embeds, pooled_prompt_embeds}; free())."""
    quantize, stream = S.t5_loading(t5_storage(model_cfg, device, budget))
    if model_cfg.name_or_path is None:
        return _random_text_encoders(model_cfg, device, quantize == "fp8", stream)
    return load_text_encoders(sd3_files(model_cfg), dtype=S.te_dtype(device), device=device,
                              t5=model_cfg.use_t5, t5_quantize=quantize, t5_stream=stream,
                              max_length=t5_max_length(model_cfg))


def _random_text_encoders(model_cfg, device, fp8, stream):
    size = _size(model_cfg)
    spec = sd3_params(size)
    max_length = t5_max_length(model_cfg)
    dev = flame.device(device)
    g = flame.Generator(dev).manual_seed(S.RANDOM_SEED)
    if size == TINY:
        (l_cfg, l_tok), (g_cfg, g_tok) = S.tiny_clip("clip_l", 12, 8), S.tiny_clip("clip_g", 16, 8)
        t5_cfg, t5_tok = S.tiny_t5(spec.context_in_dim)
    else:
        (l_cfg, l_tok), (g_cfg, g_tok) = S.released_clip("clip_l"), S.released_clip("clip_g")
        t5_cfg, t5_tok = S.released_t5(max_length)
    clip_l = S.random_clip(l_cfg, True, dev, g)
    clip_g = S.random_clip(g_cfg, True, dev, g)
    t5 = S.random_t5(t5_cfg, dev, g, fp8, stream) if model_cfg.use_t5 else None
    return SD3TextEncoders(clip_l, clip_g, t5, l_tok, g_tok, t5_tok if t5 is not None else None,
                           max_length=max_length, context_dim=spec.context_in_dim)
