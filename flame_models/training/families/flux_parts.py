"""The parts of a Flux run besides the transformer -- the VAE, CLIP-L and T5 with their tokenizers -- for image
folders and text prompts: found from the config's files (flame_models.flux.pipeline), or built with random weights
at the real sizes of `model.size` (no files: benchmarks), or, for `flux-tiny`, the tiny demo's parts.

Files: model.name_or_path a diffusers Flux folder (transformer/, vae/, text_encoder/, text_encoder_2/, tokenizer/,
tokenizer_2/) or a transformer file with model.vae_path / clip_l_path / t5_path (tokenizers: model.tokenizer_path,
else the folder's, else the vocabularies packaged with FLAME). Only headers are read before the stages run.

Random parts (model.size, no name_or_path): flux-dev / flux-schnell: the Flux VAE, CLIP-L and T5-XXL at their
released sizes with random weights drawn on the device (random_init), the packaged tokenizers; flux-tiny: the
analytic pooling VAE (analytic_vae.py: its decoded previews mean something), a 2-layer CLIP and T5 as wide as the
preset's vec_in_dim / context_in_dim, tokenizers learned from flame_models.flux.tiny.TINY_CORPUS.

Memory: T5 is stored in fp8 when model.quantize_te asks, or when max_gpu_memory cannot hold it in bfloat16 beside
CLIP with a margin; its blocks are streamed from host memory when even fp8 does not fit.
"""
import os

import flame_core as flame
import flame_nn

from ...flux.components import FluxFilesError, find_flux_files, part_files, read_headers
from ...flux.conditioning import FluxTextEncoders, check_vocabularies, load_tokenizers
from ...flux.pipeline import load_text_encoders, load_vae_for_flux
from ..random_init import init_random_

# the trainer's config fields in place of the generator's options in FluxFilesError messages
_FIELDS = {"--model": "model.name_or_path", "--vae": "model.vae_path", "--clip-l": "model.clip_l_path",
           "--t5": "model.t5_path", "--tokenizer": "model.tokenizer_path"}
_PARTS = {"vae": ("vae",), "text": ("clip_l", "t5", "clip_tokenizer", "t5_tokenizer")}
PATH_FIELDS = ("vae_path", "clip_l_path", "t5_path", "tokenizer_path")
RANDOM_SEED = 0            # random parts are the same in every run (their cache entries stay valid)
ENCODER_MARGIN = 2 << 30   # CLIP-L, the activations of a batch of captions and the CUDA context, beside T5


def _fields(text):
    for opt, field in _FIELDS.items():
        text = text.replace(f"({opt})", f"({field})").replace(f"pass {opt} (", f"set {field} (")
    return text


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
            return [f"{p}model: {_fields(x)}" for x in lines if x.split(" ", 1)[0].rstrip(":") in wanted]
        if text:
            try:
                check_vocabularies(files, *load_tokenizers(files))
            except (FluxFilesError, ValueError, OSError) as e:
                return [f"{p}model: {_fields(str(e).splitlines()[0])}"]
        return []
    try:  # precomputed samples decoded with model.vae_path: only the VAE matters
        from ..model_files import describe_keys
        kind, words, key = describe_keys(read_headers(part_files(m.vae_path, "vae")))
    except FluxFilesError as e:
        return [f"{p}model.vae_path: {e}"]
    if kind != "vae":
        return [f"{p}model.vae_path: {m.vae_path} is not a VAE: it looks like {words}"]
    return []


def _identity(path, part):
    """Names, sizes and modification times of a part's files: a changed file gives another cache key."""
    out = []
    for f in part_files(path, part):
        st = os.stat(f)
        out.append(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(out)


def _size(model_cfg):
    return model_cfg.size or "flux-tiny"


# ----------------------------------------------------------------------------- the VAE
def vae_id(model_cfg, device):
    m = model_cfg
    dt = _vae_dtype(device)
    if m.name_or_path is None:
        return f"flux-vae|random:{_size(m)}:{RANDOM_SEED}|{dt or 'file'}"
    path = m.vae_path or flux_files(m).vae
    return f"flux-vae|{_identity(path, 'vae')}|{dt or 'file'}"


def _vae_dtype(device):
    """None (the file's own dtype) on cuda; float32 on the cpu, where bfloat16 is emulated."""
    return None if flame.device(device).type == "cuda" else flame.float32


def load_vae(model_cfg, device):
    m = model_cfg
    if m.name_or_path is None:
        return _random_vae(_size(m), device)
    path = m.vae_path or flux_files(m).vae
    return load_vae_for_flux(path, dtype=_vae_dtype(device), device=device)


def _random_vae(size, device):
    from ...vae import AutoencoderKL
    if size == "flux-tiny":
        from ..analytic_vae import analytic_vae
        return analytic_vae(device=device)
    dt = flame.bfloat16 if flame.device(device).type == "cuda" else flame.float32
    with flame_nn.empty_init(device=device, dtype=dt):
        vae = AutoencoderKL("flux")
    init_random_(vae, flame.Generator(device).manual_seed(RANDOM_SEED))
    vae.requires_grad_(False)
    vae.eval()
    return vae


# ----------------------------------------------------------------------------- the text encoders
def _te_dtype(device):
    return flame.bfloat16 if flame.device(device).type == "cuda" else flame.float32


def text_id(model_cfg, device, budget):
    m = model_cfg
    how = f"{_te_dtype(device)}|t5:{t5_storage(model_cfg, device, budget)}"
    if m.name_or_path is None:
        from ...flux.params import flux_params
        return f"flux-te|random:{_size(m)}:{RANDOM_SEED}:{t5_max_length(m, flux_params(_size(m)).guidance_embed)}|{how}"
    f = flux_files(m)
    return (f"flux-te|{_identity(f.clip_l, 'clip_l')}|{_identity(f.t5, 't5')}|tok:{f.clip_tokenizer}:"
            f"{f.t5_tokenizer}:{t5_max_length(m, f.is_dev)}|{how}")


def _t5_params(model_cfg):
    if model_cfg.name_or_path is None:
        from ...text_encoders import T5_PRESETS
        c = T5_PRESETS["t5-xxl"] if _size(model_cfg) != "flux-tiny" else None
        return 0 if c is None else _t5_count(c)
    shapes = read_headers(part_files(flux_files(model_cfg).t5, "t5"))
    n = 0
    for s in shapes.values():
        k = 1
        for d in s:
            k *= d
        n += k
    return n


def _t5_count(c):
    per_block = 4 * c.d_model * c.num_heads * c.d_kv + 3 * c.d_model * c.d_ff + 2 * c.d_model
    return c.vocab_size * c.d_model + c.num_layers * per_block


def t5_storage(model_cfg, device, budget):
    """'bf16' | 'fp8' | 'fp8+stream' ('float32' on the cpu): how T5 is held while captions are encoded (see the
    module docstring; a T5 file stored in fp8 stays in fp8 either way)."""
    if flame.device(device).type != "cuda":
        return "fp8" if model_cfg.quantize_te else "float32"
    fp8 = bool(model_cfg.quantize_te)
    if budget is None:
        return "fp8" if fp8 else "bf16"
    n = _t5_params(model_cfg)
    if not fp8 and 2 * n + ENCODER_MARGIN > budget:
        fp8 = True
    if fp8 and n + ENCODER_MARGIN > budget:
        return "fp8+stream"
    return "fp8" if fp8 else "bf16"


def load_text_encoders_for(model_cfg, device, budget=None):
    """FluxTextEncoders (encode(prompts) -> {prompt_embeds, pooled_prompt_embeds}; free())."""
    storage = t5_storage(model_cfg, device, budget)
    quantize = "fp8" if storage.startswith("fp8") else "auto"  # (auto: a file stored in fp8 stays in fp8)
    stream = storage.endswith("stream")
    if model_cfg.name_or_path is None:
        return _random_text_encoders(model_cfg, device, quantize, stream)
    files = flux_files(model_cfg)
    return load_text_encoders(files, dtype=_te_dtype(device), device=device, t5_quantize=quantize,
                              t5_stream=stream, max_length=t5_max_length(model_cfg, files.is_dev))


def t5_max_length(model_cfg, is_dev):
    """T5 tokens per caption: model.t5_max_length, else 512 for flux-dev and 256 for schnell."""
    return model_cfg.t5_max_length or (512 if is_dev else 256)


def _random_text_encoders(model_cfg, device, quantize, stream):
    quantize = quantize if quantize == "fp8" else None
    from ...flux.params import flux_params
    from ...text_encoders import CLIP_PRESETS, CLIPTextConfig, CLIPTextModel, T5_PRESETS, T5Config, T5EncoderModel
    from ...tokenization import CLIPTokenizer, T5Tokenizer, load_tokenizer
    size = _size(model_cfg)
    spec = flux_params(size)
    max_length = t5_max_length(model_cfg, spec.guidance_embed)
    dev, dt = flame.device(device), _te_dtype(device)
    if size == "flux-tiny":
        from ...flux.tiny import TINY_CORPUS
        clip_tok = CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=600)
        t5_tok = T5Tokenizer.train_tiny(TINY_CORPUS, vocab_size=120, model_max_length=512)
        clip_cfg = CLIPTextConfig(vocab_size=clip_tok.vocab_size, hidden_size=spec.vec_in_dim,
                                  intermediate_size=2 * spec.vec_in_dim, projection_dim=spec.vec_in_dim,
                                  num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                  hidden_act="quick_gelu", bos_token_id=clip_tok.bos_token_id,
                                  eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id)
        t5_cfg = T5Config(vocab_size=t5_tok.vocab_size, d_model=spec.context_in_dim, d_kv=8, d_ff=48, num_layers=2,
                          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    else:
        clip_tok = load_tokenizer("clip_l")
        t5_tok = load_tokenizer("t5", max_length=max_length)
        c = CLIP_PRESETS["clip-l"]
        clip_cfg = CLIPTextConfig(**{**c.to_dict(), "bos_token_id": clip_tok.bos_token_id,
                                     "eos_token_id": clip_tok.eos_token_id, "pad_token_id": clip_tok.pad_token_id})
        t5_cfg = T5_PRESETS["t5-xxl"]
    with flame_nn.empty_init(device=dev, dtype=dt):
        clip = CLIPTextModel(clip_cfg)
        t5 = T5EncoderModel(t5_cfg)
    g = flame.Generator(dev).manual_seed(RANDOM_SEED)
    init_random_(clip, g)
    blocks = t5.encoder.block

    def fill_block(block):
        init_random_(block, g)
        if quantize and not stream:
            flame_nn.offload.quantize_linear_weights_(block)
    init_random_(t5.shared, g)
    init_random_(t5.encoder.final_layer_norm, g)
    if stream:
        t5.streamer = flame_nn.offload.BlockStreamer(blocks, device=dev, prefixes=["encoder.block"],
                                                     quantize=quantize, prepare=init_random_)
    else:
        for block in blocks:
            fill_block(block)
    for m in (clip, t5):
        m.requires_grad_(False)
        m.eval()
    return FluxTextEncoders(clip, t5, clip_tok, t5_tok, max_length=max_length)
