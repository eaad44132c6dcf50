"""What the families' parts share (flux/family_parts.py, sd3/..., sdxl/...): the config's fields in place of the
generator's options in the find_*_files messages, the problems of SD3's and SDXL's files, cache identities of files,
the dtypes the stages run in, how T5 is held, and random parts -- VAEs, CLIP towers, T5 and tokenizers -- at the
released sizes (benchmarks without files) or tiny (the `-tiny` presets: the analytic pooling VAE, so decoded previews
mean something, and tokenizers learned from tokenization.tiny_corpus.TINY_CORPUS).
"""
import gc
import os

import flame_core as flame
import flame_nn

from ..conditioning import files as F
from .random_init import init_random_

RANDOM_SEED = 0             # random parts are the same in every run (their cache entries stay valid)
ENCODER_MARGIN = 2 << 30    # a CLIP-L, a batch of captions' activations and the CUDA context, beside T5

# the trainer's config fields in place of the generator's options in the files' messages
OPTION_FIELDS = {"--model": "model.name_or_path", "--vae": "model.vae_path", "--clip-l": "model.clip_l_path",
                 "--clip-g": "model.clip_g_path", "--t5": "model.t5_path", "--tokenizer": "model.tokenizer_path"}
TOKENIZER_PARTS = {"clip_l_tokenizer", "clip_g_tokenizer", "t5_tokenizer", "tokenizer"}


def fields_text(text):
    for opt, fld in OPTION_FIELDS.items():
        text = text.replace(f"({opt})", f"({fld})").replace(f"pass {opt} (", f"set {fld} (")
    return text


def problem_lines(error, what, path):
    """The one-line problems of a find_*_files error (F.report's format: one problem after "the <what> <path>: ",
    or a heading line and one problem per line)."""
    lines = str(error).splitlines()
    if len(lines) == 1:
        head = f"the {what} {path}: "
        return [lines[0][len(head):] if lines[0].startswith(head) else lines[0]]
    return [x.strip() for x in lines[1:]]


def part_of(line):
    """The part a problem line is about ("clip_l (--clip-l): ...", "vae: missing -- ...")."""
    return line.split(" ", 1)[0].rstrip(":")


def file_problems(find, model_cfg, wanted, what, prefix=""):
    """Problems (config-field wording) of find(model_cfg) about the parts in `wanted` (the main part's always)."""
    try:
        return find(model_cfg), []
    except F.ModelFilesError as e:
        lines = problem_lines(e, what, model_cfg.name_or_path)
        return None, [f"{prefix}model: {fields_text(x)}" for x in lines if part_of(x) in wanted]


def problems(model_cfg, find, main, encoders, what, size, path_fields, *, vae, text, prefix="", vocabularies,
             notes=()):
    """What is wrong with the parts a run needs (vae: the VAE; text: the text `encoders` and tokenizers), from
    headers and tokenizer files only: path fields given for random parts; find(model_cfg)'s problems with the `main`
    part and the wanted ones; then `notes` and what vocabularies(files) raises (text only)."""
    m, p = model_cfg, prefix
    if m.name_or_path is None:
        return [f"{p}model.{k}: model.size {size} builds random parts; give model.name_or_path for files"
                for k in path_fields if getattr(m, k) is not None]
    wanted = {main} | ({"vae"} if vae else set()) | (set(encoders) | TOKENIZER_PARTS if text else set())
    files, e = file_problems(find, m, wanted, what, p)
    if files is None or not text:
        return e
    e += notes
    try:
        vocabularies(files)
    except (F.ModelFilesError, ValueError, OSError) as ex:
        e.append(f"{p}model: {fields_text(str(ex).splitlines()[0])}")
    return e


def identity(path, part, prefix="", subfolders=None, error=F.ModelFilesError):
    """Names, sizes and modification times of a part's files (and its key prefix inside them): a changed file gives
    another cache key."""
    out = [f"{os.path.abspath(f)}:{os.stat(f).st_size}:{os.stat(f).st_mtime_ns}"
           for f in F.part_files(path, part, subfolders=subfolders, error=error)]
    return "|".join(out) + (f"#{prefix}" if prefix else "")


def part_identity(files, part, subfolders):
    """identity() of a part of found files (SD3Files, SDXLFiles: its path, and its key prefix in a single file)."""
    return identity(getattr(files, part), part, files.prefixes.get(part, ""), subfolders)


def parameter_count(path, part, prefix="", subfolders=None, error=F.ModelFilesError):
    """Elements of the tensors under `prefix` of a part's files (headers only)."""
    n = 0
    for k, shape in F.read_headers(F.part_files(path, part, subfolders=subfolders, error=error), error=error).items():
        if k.startswith(prefix):
            c = 1
            for d in shape:
                c *= d
            n += c
    return n


# ----------------------------------------------------------------------------- dtypes and storage
def vae_dtype(device):
    """None (the file's own dtype) on cuda; float32 on the cpu, where bfloat16 is emulated."""
    return None if flame.device(device).type == "cuda" else flame.float32


def te_dtype(device):
    return flame.bfloat16 if flame.device(device).type == "cuda" else flame.float32


def t5_storage(count, quantize_te, device, budget, beside=None):
    """'bf16' | 'fp8' | 'fp8+stream' ('float32' / 'fp8' on the cpu): how T5 is held while captions are encoded --
    fp8 when model.quantize_te asks or when max_gpu_memory cannot hold it in bfloat16 beside the other encoders
    with a margin; its blocks streamed when even fp8 does not fit. count(): T5's parameters; beside(): the
    parameters of the encoders held with it in bfloat16 beyond the one CLIP-L the margin counts (SD3's CLIP-G and
    CLIP-L); both called only for a budget."""
    if flame.device(device).type != "cuda":
        return "fp8" if quantize_te else "float32"
    fp8 = bool(quantize_te)
    if budget is None:
        return "fp8" if fp8 else "bf16"
    n_params = count()
    other = ENCODER_MARGIN + (2 * beside() if beside is not None else 0)
    if not fp8 and 2 * n_params + other > budget:
        fp8 = True
    if fp8 and n_params + other > budget:
        return "fp8+stream"
    return "fp8" if fp8 else "bf16"


def t5_loading(storage):
    """(t5_quantize, t5_stream) for the loaders from a t5_storage answer ('auto': a file stored in fp8 stays fp8)."""
    return ("fp8" if storage.startswith("fp8") else "auto"), storage.endswith("stream")


def t5_params_count(c):
    """Parameters of a T5Config (the released T5-XXL's when the preset is used)."""
    per_block = 4 * c.d_model * c.num_heads * c.d_kv + 3 * c.d_model * c.d_ff + 2 * c.d_model
    return c.vocab_size * c.d_model + c.num_layers * per_block


# ----------------------------------------------------------------------------- cache keys and the VAE
def cache_id(kind, model_cfg, size, how, files_key, random_more=None):
    """A stage's cache key (image_data.py): `kind` ('sd3-te'); the random `size` preset (and random_more(): what
    else its random parts depend on) without model.name_or_path, else files_key() (its files' identities); `how`
    the stage runs (dtypes, T5's storage)."""
    if model_cfg.name_or_path is None:
        where = f"random:{size}:{RANDOM_SEED}" + (random_more() if random_more is not None else "")
    else:
        where = files_key()
    return f"{kind}|{where}|{how}"


def vae_id(kind, model_cfg, size, device, files_key):
    """The VAE's cache_id: `kind` ('sd3'), its files or random preset, the dtype it runs in ('file': its own)."""
    return cache_id(f"{kind}-vae", model_cfg, size, vae_dtype(device) or "file", files_key)


def load_vae(kind, model_cfg, tiny, z_channels, device, load, where):
    """The VAE: random_vae without model.name_or_path, else load(where(model_cfg), dtype=, device=)."""
    if model_cfg.name_or_path is None:
        return random_vae(kind, tiny, z_channels, device)
    return load(where(model_cfg), dtype=vae_dtype(device), device=device)


# ----------------------------------------------------------------------------- random parts
def random_vae(kind, tiny, z_channels, device):
    """The analytic pooling VAE with `z_channels` (tiny), else an AutoencoderKL(kind) ('sd3', 'sdxl') with random
    weights drawn on `device`."""
    from ..vae import AutoencoderKL
    if tiny:
        from .analytic_vae import analytic_vae
        return analytic_vae(device=device, z_channels=z_channels)
    dt = flame.bfloat16 if flame.device(device).type == "cuda" else flame.float32
    with flame_nn.empty_init(device=device, dtype=dt):
        vae = AutoencoderKL(kind)
    init_random_(vae, flame.Generator(device).manual_seed(RANDOM_SEED))
    vae.requires_grad_(False)
    vae.eval()
    return vae


def tiny_clip(kind, hidden, projection_dim):
    """(CLIPTextConfig, tokenizer) of a 2-layer CLIP `hidden` wide with a tokenizer learned from the tiny corpus
    (kind 'clip_l' pads with EOS, 'clip_g' with '!', as the released tokenizers)."""
    from ..text_encoders import CLIPTextConfig
    from ..tokenization import CLIPTokenizer
    from ..tokenization.tiny_corpus import TINY_CORPUS
    tok = CLIPTokenizer.train_tiny(TINY_CORPUS, vocab_size=600, kind=kind)
    cfg = CLIPTextConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         projection_dim=projection_dim, num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=77, hidden_act="quick_gelu" if kind == "clip_l" else "gelu",
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return cfg, tok


def released_clip(kind):
    """(CLIPTextConfig, packaged tokenizer) of the released CLIP-L / CLIP-G text towers."""
    from ..text_encoders import CLIP_PRESETS, CLIPTextConfig
    from ..tokenization import load_tokenizer
    tok = load_tokenizer(kind)
    c = CLIP_PRESETS["clip-l" if kind == "clip_l" else "clip-g"]
    return CLIPTextConfig(**{**c.to_dict(), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                             "pad_token_id": tok.pad_token_id}), tok


def random_clip(config, projection, device, generator):
    """A frozen CLIPTextModel[WithProjection] of `config` with random weights drawn on `device`."""
    from ..text_encoders import CLIPTextModel, CLIPTextModelWithProjection, is_structure_only
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    structure = is_structure_only()   # (its layers only: text_encoders/structure.py)
    with flame_nn.empty_init(device="cpu" if structure else flame.device(device), dtype=te_dtype(device)):
        model = cls(config)
    if not structure:
        init_random_(model, generator)
    model.requires_grad_(False)
    model.eval()
    return model


def tiny_t5(d_model):
    """(T5Config, tokenizer) of a 2-layer T5 `d_model` wide with a tokenizer learned from the tiny corpus."""
    from ..text_encoders import T5Config
    from ..tokenization import T5Tokenizer
    from ..tokenization.tiny_corpus import TINY_CORPUS
    tok = T5Tokenizer.train_tiny(TINY_CORPUS, vocab_size=120, model_max_length=512)
    return T5Config(vocab_size=tok.vocab_size, d_model=d_model, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, relative_attention_max_distance=16), tok


def released_t5(max_length):
    """(T5Config, packaged tokenizer) of the released T5-XXL encoder."""
    from ..text_encoders import T5_PRESETS
    from ..tokenization import load_tokenizer
    return T5_PRESETS["t5-xxl"], load_tokenizer("t5", max_length=max_length)


def random_t5(config, device, generator, fp8, stream):
    """A frozen T5EncoderModel of `config` with random weights drawn on `device` (its Linear weights stored in fp8
    with `fp8`); with `stream`, its blocks stay empty and a BlockStreamer fills each as it packs it."""
    from ..text_encoders import T5EncoderModel, is_structure_only
    dev = flame.device(device)
    structure = is_structure_only()   # (its layers only: text_encoders/structure.py)
    with flame_nn.empty_init(device="cpu" if structure else dev, dtype=te_dtype(dev)):
        t5 = T5EncoderModel(config)
    t5.requires_grad_(False)   # before quantising: fp8 storage converts frozen Linears only
    if structure:
        return t5.eval()
    init_random_(t5.shared, generator)
    init_random_(t5.encoder.final_layer_norm, generator)
    if stream:
        t5.streamer = flame_nn.offload.BlockStreamer(t5.encoder.block, device=dev, prefixes=["encoder.block"],
                                                     quantize="fp8" if fp8 else None, prepare=init_random_)
    else:
        park = fp8 and dev.type == "cuda"
        for block in t5.encoder.block:
            init_random_(block, generator)
            if fp8:
                flame_nn.offload.quantize_linear_weights_(block)
            if park:   # drawn blocks wait in host memory: the draws' temporaries would fragment the pool around them
                block.to("cpu")
        if park:
            gc.collect()
            flame.memory.empty_cache(dev)
            for block in t5.encoder.block:
                block.to(dev)
    t5.eval()
    return t5
