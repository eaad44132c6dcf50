"""The parts of an SDXL run besides the UNet -- the VAE, CLIP-L, CLIP-G (with its projection) and their tokenizers --
for image folders and text prompts: found from the config's files (flame_models.sdxl.components.find_sdxl_files), or
built with random weights at the sizes of `model.size`.

Files: model.name_or_path an SAI single file (sd_xl_base_1.0.safetensors: first_stage_model., conditioner.embedders
.0/.1), a diffusers folder (unet/, vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/), or a UNet file
with model.vae_path / clip_l_path / clip_g_path (tokenizers: model.tokenizer_path, else the folder's, else the
vocabulary packaged with FLAME). Only headers are read before the stages run. The VAE encodes and decodes in its
file's dtype on the GPU -- float32 for a float16 VAE, which overflows (flame_models.sdxl.pipeline) -- and in float32
on the cpu.

Random parts (model.size, no name_or_path): sdxl-base: the SDXL VAE, CLIP-L and CLIP-G at their released sizes with
random weights drawn on the device, the packaged tokenizers; sdxl-tiny: the analytic pooling VAE with 4 latent
channels and 2-layer CLIPs 8 wide each (the preset's context width 16) with CLIP-G projecting to the preset's pooled
width, tokenizers learned from the tiny corpus.
"""
import flame_core as flame

from ...sdxl.components import SUBFOLDERS, find_sdxl_files
from ...sdxl.conditioning import SDXLTextEncoders, check_vocabularies, load_text_encoders, load_tokenizers
from ...sdxl.config import unet_config
from ...sdxl.pipeline import load_vae_for_sdxl
from . import sd_parts as S

PATH_FIELDS = ("vae_path", "clip_l_path", "clip_g_path", "tokenizer_path")
WHAT = "SDXL model"
TINY = "sdxl-tiny"


def sdxl_files(model_cfg):
    """SDXLFiles of the config's model and parts (headers read); SDXLFilesError listing every problem."""
    m = model_cfg
    return find_sdxl_files(m.name_or_path, vae=m.vae_path, clip_l=m.clip_l_path, clip_g=m.clip_g_path,
                           tokenizer=m.tokenizer_path)


def _size(model_cfg):
    return model_cfg.size or TINY


def problems(cfg, *, vae, text, prefix=""):
    """What is wrong with the parts a run needs (vae: the VAE; text: the text encoders and tokenizers), read from
    headers and tokenizer files only."""
    m = cfg.model
    return S.problems(m, sdxl_files, "unet", ("clip_l", "clip_g"), WHAT, _size(m), PATH_FIELDS, vae=vae, text=text,
                      prefix=prefix, vocabularies=lambda files: check_vocabularies(files, *load_tokenizers(files)))


# ----------------------------------------------------------------------------- the VAE
def vae_id(model_cfg, device):
    m = model_cfg
    dt = S.vae_dtype(device)
    if m.name_or_path is None:
        return f"sdxl-vae|random:{_size(m)}:{S.RANDOM_SEED}|{dt or 'file'}"
    f = sdxl_files(m)
    return f"sdxl-vae|{S.identity(f.vae, 'vae', f.prefixes.get('vae', ''), SUBFOLDERS)}|{dt or 'file'}"


def load_vae(model_cfg, device):
    m = model_cfg
    if m.name_or_path is None:
        return S.random_vae("sdxl", _size(m) == TINY, 4, device)
    return load_vae_for_sdxl(sdxl_files(m), dtype=S.vae_dtype(device), device=device)


# ----------------------------------------------------------------------------- the text encoders
def text_id(model_cfg, device, budget=None):
    m = model_cfg
    if m.name_or_path is None:
        return f"sdxl-te|random:{_size(m)}:{S.RANDOM_SEED}|{S.te_dtype(device)}"
    f = sdxl_files(m)
    parts = [S.identity(getattr(f, k), k, f.prefixes.get(k, ""), SUBFOLDERS) for k in ("clip_l", "clip_g")]
    return f"sdxl-te|{'|'.join(parts)}|tok:{f.clip_l_tokenizer}:{f.clip_g_tokenizer}|{S.te_dtype(device)}"


def describe(model_cfg, device, budget):
    return "CLIP-L + CLIP-G"


def load_text_encoders_for(model_cfg, device, budget=None):
    """SDXLTextEncoders (encode(prompts) -> {prompt_embeds (77, 2048), pooled_prompt_embeds (1280)}; free())."""
    if model_cfg.name_or_path is None:
        return _random_text_encoders(model_cfg, device)
    return load_text_encoders(sdxl_files(model_cfg), dtype=S.te_dtype(device), device=device)


def _random_text_encoders(model_cfg, device):
    size = _size(model_cfg)
    c = unet_config(size)
    dev = flame.device(device)
    g = flame.Generator(dev).manual_seed(S.RANDOM_SEED)
    if size == TINY:
        half = c.context_dim // 2
        (l_cfg, l_tok), (g_cfg, g_tok) = S.tiny_clip("clip_l", half, half), \
            S.tiny_clip("clip_g", c.context_dim - half, c.pooled_dim)
    else:
        (l_cfg, l_tok), (g_cfg, g_tok) = S.released_clip("clip_l"), S.released_clip("clip_g")
    return SDXLTextEncoders(S.random_clip(l_cfg, False, dev, g), S.random_clip(g_cfg, True, dev, g), l_tok, g_tok)
