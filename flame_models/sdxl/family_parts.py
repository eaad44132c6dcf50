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

from ..training import family_parts as S
from .components import SUBFOLDERS, find_sdxl_files
from .conditioning import SDXLTextEncoders, check_vocabularies, load_text_encoders, load_tokenizers
from .config import unet_config
from .pipeline import load_vae_for_sdxl

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
    """sd_parts.problems of an SDXL model's parts (the UNet, the VAE, CLIP-L, CLIP-G and their tokenizers)."""
    m = cfg.model
    return S.problems(m, sdxl_files, "unet", ("clip_l", "clip_g"), WHAT, _size(m), PATH_FIELDS, vae=vae, text=text,
                      prefix=prefix, vocabularies=lambda files: check_vocabularies(files, *load_tokenizers(files)))


# ----------------------------------------------------------------------------- the VAE
def vae_id(model_cfg, device):
    return S.vae_id("sdxl", model_cfg, _size(model_cfg), device,
                    lambda: S.part_identity(sdxl_files(model_cfg), "vae", SUBFOLDERS))


def load_vae(model_cfg, device):
    return S.load_vae("sdxl", model_cfg, _size(model_cfg) == TINY, 4, device, load_vae_for_sdxl, sdxl_files)


# ----------------------------------------------------------------------------- the text encoders
def text_id(model_cfg, device, budget=None):
    def files_key():
        f = sdxl_files(model_cfg)
        parts = [S.part_identity(f, k, SUBFOLDERS) for k in ("clip_l", "clip_g")]
        return f"{'|'.join(parts)}|tok:{f.clip_l_tokenizer}:{f.clip_g_tokenizer}"
    return S.cache_id("sdxl-te", model_cfg, _size(model_cfg), S.te_dtype(device), files_key)


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
