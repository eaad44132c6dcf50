"""The parts of a Chroma run besides the transformer -- the Flux VAE and T5 with its tokenizer -- for image folders
and text prompts: found from the config's files (components.find_chroma_files), or random at the sizes of
`model.size` (chroma: the Flux VAE and T5-XXL with random weights drawn on the device; chroma-tiny: the analytic
pooling VAE and a 2-layer T5 as wide as the preset's context_in_dim, its tokenizer learned from the tiny corpus).

Files: model.name_or_path a diffusers Chroma folder (transformer/, vae/, text_encoder/, tokenizer/) or a transformer
file with model.vae_path / t5_path (tokenizer: model.tokenizer_path, else the folder's, else the packaged one).
Memory: T5 in fp8 when model.quantize_te asks or max_gpu_memory cannot hold it in bfloat16, streamed when even fp8
does not fit (training.family_parts.t5_storage)."""
import flame_core as flame

from ..bfl.vae import load_vae_for_flux
from ..training import family_parts as S
from .components import SUBFOLDERS, T5_MAX_LENGTH, find_chroma_files
from .conditioning import ChromaTextEncoders, check_vocabulary, load_text_encoders, load_tokenizer_for

PATH_FIELDS = ("vae_path", "t5_path", "tokenizer_path")
WHAT = "Chroma model"
TINY = "chroma-tiny"


def chroma_files(model_cfg):
    m = model_cfg
    return find_chroma_files(m.name_or_path, vae=m.vae_path, t5=m.t5_path, tokenizer=m.tokenizer_path)


def _size(model_cfg):
    return model_cfg.size or TINY


def t5_max_length(model_cfg):
    """T5 tokens per caption: model.t5_max_length, else 512 (diffusers' ChromaPipeline)."""
    return model_cfg.t5_max_length or T5_MAX_LENGTH


def problems(cfg, *, vae, text, prefix=""):
    m = cfg.model
    notes = [f"{prefix}model.clip_l_path: Chroma has no CLIP"] if m.clip_l_path is not None else []
    return S.problems(m, chroma_files, "transformer", ("t5",), WHAT, _size(m), PATH_FIELDS, vae=vae, text=text,
                      prefix=prefix, notes=notes,
                      vocabularies=lambda files: check_vocabulary(files, load_tokenizer_for(
                          files, max_length=t5_max_length(m))))


def _identity(path, part):
    return S.identity(path, part, subfolders=SUBFOLDERS)


# ----------------------------------------------------------------------------- the VAE (Flux's)
def vae_id(model_cfg, device):
    return S.vae_id("flux", model_cfg, _size(model_cfg), device,
                    lambda: _identity(chroma_files(model_cfg).vae, "vae"))


def load_vae(model_cfg, device):
    return S.load_vae("flux", model_cfg, _size(model_cfg) == TINY, 16, device, load_vae_for_flux,
                      lambda m: chroma_files(m).vae)


# ----------------------------------------------------------------------------- T5
def _t5_params(model_cfg):
    if model_cfg.name_or_path is None:
        from ..text_encoders import T5_PRESETS
        return 0 if _size(model_cfg) == TINY else S.t5_params_count(T5_PRESETS["t5-xxl"])
    return S.parameter_count(chroma_files(model_cfg).t5, "t5", subfolders=SUBFOLDERS)


def t5_storage(model_cfg, device, budget):
    return S.t5_storage(lambda: _t5_params(model_cfg), model_cfg.quantize_te, device, budget, beside=lambda: 0)


def text_id(model_cfg, device, budget):
    m = model_cfg

    def files_key():
        f = chroma_files(m)
        return f"{_identity(f.t5, 't5')}|tok:{f.t5_tokenizer}"
    how = f"{S.te_dtype(device)}|t5:{t5_storage(m, device, budget)}:{t5_max_length(m)}|mask"
    return S.cache_id("chroma-te", m, _size(m), how, files_key)


def describe(model_cfg, device, budget):
    return f"T5 ({t5_storage(model_cfg, device, budget)}, {t5_max_length(model_cfg)} tokens, padding masked)"


def load_text_encoders_for(model_cfg, device, budget=None):
    """ChromaTextEncoders (encode(prompts) -> {prompt_embeds, prompt_mask}; free())."""
    quantize, stream = S.t5_loading(t5_storage(model_cfg, device, budget))
    if model_cfg.name_or_path is None:
        from .params import chroma_params
        size = _size(model_cfg)
        dev = flame.device(device)
        g = flame.Generator(dev).manual_seed(S.RANDOM_SEED)
        t5_cfg, tok = (S.tiny_t5(chroma_params(size).context_in_dim) if size == TINY
                       else S.released_t5(t5_max_length(model_cfg)))
        return ChromaTextEncoders(S.random_t5(t5_cfg, dev, g, quantize == "fp8", stream), tok,
                                  max_length=t5_max_length(model_cfg))
    return load_text_encoders(chroma_files(model_cfg), dtype=S.te_dtype(device), device=device, t5_quantize=quantize,
                              t5_stream=stream, max_length=t5_max_length(model_cfg))
