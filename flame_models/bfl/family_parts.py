"""The parts of a Flux run besides the transformer -- the VAE, CLIP-L and T5 with their tokenizers -- for image
folders and text prompts: found from the config's files (flame_models.bfl), or built with random weights
at the real sizes of `model.size` (no files: benchmarks), or, for `flux-tiny`, the tiny demo's parts.

Files: model.name_or_path a diffusers Flux folder (transformer/, vae/, text_encoder/, text_encoder_2/, tokenizer/,
tokenizer_2/) or a transformer file with model.vae_path / clip_l_path / t5_path (tokenizers: model.tokenizer_path,
else the folder's, else the vocabularies packaged with FLAME). Only headers are read before the stages run.

Random parts (model.size, no name_or_path): flux-dev / flux-schnell: the Flux VAE, CLIP-L and T5-XXL at their
released sizes with random weights drawn on the device (random_init), the packaged tokenizers; flux-tiny: the
analytic pooling VAE (analytic_vae.py: its decoded previews mean something), a 2-layer CLIP and T5 as wide as the
preset's vec_in_dim / context_in_dim, tokenizers learned from tokenization.tiny_corpus.TINY_CORPUS.

Memory: T5 is stored in fp8 when model.quantize_te asks, or when max_gpu_memory cannot hold it in bfloat16 beside
CLIP with a margin; its blocks are streamed from host memory when even fp8 does not fit.
"""
import flame_core as flame

from ..training import family_parts as S
from .components import SUBFOLDERS, FluxFilesError, find_flux_files, part_files, read_headers
from .conditioning import FluxTextEncoders, check_vocabularies, load_text_encoders, load_tokenizers
from .vae import load_vae_for_flux

_PARTS = {"vae": ("vae",), "text": ("clip_l", "t5", "clip_tokenizer", "t5_tokenizer")}
PATH_FIELDS = ("vae_path", "clip_l_path", "t5_path", "tokenizer_path")
TINY = "flux-tiny"


def flux_files(model_cfg):
    """FluxFiles of the config's model and parts (headers read); FluxFilesError listing every problem."""
    m = model_cfg
    return find_flux_files(m.name_or_path, vae=m.vae_path, clip_l=m.clip_l_path, t5=m.t5_path,
                           tokenizer=m.tokenizer_path)


def problems(cfg, *, vae, text, prefix=""):
    """What is wrong with the parts a run needs (vae: the VAE; text: the text encoders and tokenizers), read from
    headers and tokenizer files only."""
    m, p = cfg.model, prefix
    if m.name_or_path is None:
        return [f"{p}model.{k}: model.size {m.size or 'flux-tiny'} builds random parts; give model.name_or_path "
                f"for files" for k in PATH_FIELDS if getattr(m, k) is not None]
    if text or m.vae_path is None:
        try:
            files = flux_files(m)
        except FluxFilesError as e:
            wanted = ("transformer",) + (_PARTS["vae"] if vae else ()) + (_PARTS["text"] if text else ())
            lines = [x.strip() for x in str(e).splitlines()[1:]]
            return [f"{p}model: {S.fields_text(x)}" for x in lines if x.split(" ", 1)[0].rstrip(":") in wanted]
        if text:
            try:
                check_vocabularies(files, *load_tokenizers(files))
            except (FluxFilesError, ValueError, OSError) as e:
                return [f"{p}model: {S.fields_text(str(e).splitlines()[0])}"]
        return []
    try:  # precomputed samples decoded with model.vae_path: only the VAE matters
        from ..training.model_files import describe_keys
        kind, words, key = describe_keys(read_headers(part_files(m.vae_path, "vae")))
    except FluxFilesError as e:
        return [f"{p}model.vae_path: {e}"]
    if kind != "vae":
        return [f"{p}model.vae_path: {m.vae_path} is not a VAE: it looks like {words}"]
    return []


def _identity(path, part):
    return S.identity(path, part, subfolders=SUBFOLDERS, error=FluxFilesError)


def _size(model_cfg):
    return model_cfg.size or TINY


# ----------------------------------------------------------------------------- the VAE
def _vae_path(model_cfg):
    return model_cfg.vae_path or flux_files(model_cfg).vae


def vae_id(model_cfg, device):
    return S.vae_id("flux", model_cfg, _size(model_cfg), device, lambda: _identity(_vae_path(model_cfg), "vae"))


def load_vae(model_cfg, device):
    return S.load_vae("flux", model_cfg, _size(model_cfg) == TINY, 16, device, load_vae_for_flux, _vae_path)


# ----------------------------------------------------------------------------- the text encoders
def text_id(model_cfg, device, budget):
    from .params import flux_params
    m = model_cfg

    def files_key():
        f = flux_files(m)
        return (f"{_identity(f.clip_l, 'clip_l')}|{_identity(f.t5, 't5')}|tok:{f.clip_tokenizer}:{f.t5_tokenizer}:"
                f"{t5_max_length(m, f.is_dev)}")
    how = f"{S.te_dtype(device)}|t5:{t5_storage(m, device, budget)}"
    return S.cache_id("flux-te", m, _size(m), how, files_key,
                      lambda: f":{t5_max_length(m, flux_params(_size(m)).guidance_embed)}")


def _t5_params(model_cfg):
    if model_cfg.name_or_path is None:
        from ..text_encoders import T5_PRESETS
        return 0 if _size(model_cfg) == TINY else S.t5_params_count(T5_PRESETS["t5-xxl"])
    return S.parameter_count(flux_files(model_cfg).t5, "t5", subfolders=SUBFOLDERS, error=FluxFilesError)


def t5_storage(model_cfg, device, budget):
    """'bf16' | 'fp8' | 'fp8+stream' ('float32' on the cpu): how T5 is held while captions are encoded (see the
    module docstring; a T5 file stored in fp8 stays in fp8 either way)."""
    return S.t5_storage(lambda: _t5_params(model_cfg), model_cfg.quantize_te, device, budget)


def describe(model_cfg, device, budget):
    return f"CLIP-L + T5 ({t5_storage(model_cfg, device, budget)})"


def load_text_encoders_for(model_cfg, device, budget=None):
    """FluxTextEncoders (encode(prompts) -> {prompt_embeds, pooled_prompt_embeds}; free())."""
    quantize, stream = S.t5_loading(t5_storage(model_cfg, device, budget))
    if model_cfg.name_or_path is None:
        return _random_text_encoders(model_cfg, device, quantize == "fp8", stream)
    files = flux_files(model_cfg)
    return load_text_encoders(files, dtype=S.te_dtype(device), device=device, t5_quantize=quantize,
                              t5_stream=stream, max_length=t5_max_length(model_cfg, files.is_dev))


def t5_max_length(model_cfg, is_dev):
    """T5 tokens per caption: model.t5_max_length, else 512 for flux-dev and 256 for schnell."""
    return model_cfg.t5_max_length or (512 if is_dev else 256)


def _random_text_encoders(model_cfg, device, fp8, stream):
    from .params import flux_params
    size = _size(model_cfg)
    spec = flux_params(size)
    max_length = t5_max_length(model_cfg, spec.guidance_embed)
    dev = flame.device(device)
    g = flame.Generator(dev).manual_seed(S.RANDOM_SEED)
    if size == TINY:
        clip_cfg, clip_tok = S.tiny_clip("clip_l", spec.vec_in_dim, spec.vec_in_dim)
        t5_cfg, t5_tok = S.tiny_t5(spec.context_in_dim)
    else:
        clip_cfg, clip_tok = S.released_clip("clip_l")
        t5_cfg, t5_tok = S.released_t5(max_length)
    clip = S.random_clip(clip_cfg, False, dev, g)
    return FluxTextEncoders(clip, S.random_t5(t5_cfg, dev, g, fp8, stream), clip_tok, t5_tok, max_length=max_length)
