"""The parts of a Qwen-Image run besides the transformer -- its VAE and the Qwen2.5-VL language model with its
tokenizer -- for image folders and text prompts: from a diffusers QwenImagePipeline folder (vae/, text_encoder/,
tokenizer/; model.vae_path may name another VAE), or random at the sizes of `model.size` without files. The random
tiny preset is explicit stand-ins, not the model: the analytic pooling VAE (16 channels), a 2-layer Qwen2.5-VL text
model as wide as the preset's joint_attention_dim, and a byte-level BPE tokenizer learned from the tiny corpus and
the prompt template (its template prefix is however many tokens that tokenizer makes; the released one's is 34).
`model.size: qwen-image` without files (benchmarks of the released sizes: memory, time) draws the released
AutoencoderKLQwenImage and the released Qwen2.5-VL-7B language model (28 layers, 3584 wide) at random, with that same
stand-in tokenizer: Qwen's own 151k-token vocabulary is not packaged with FLAME, and the stand-in's ids are valid rows
of the released embedding. Such a run measures the real model's cost, not its text understanding.

Captions become TEXT_LENGTH tokens per sample (the valid ones after the template prefix, zero-padded, the mask
saying which): one shape for the caches and batches, and the same velocity as the pipeline's longest-in-batch
padding (padded keys are masked)."""
import os

import numpy as np

import flame_core as flame
import flame_nn

from ..conditioning import files as F
from ..conditioning.encoders import EncoderBundle, prompt_list
from ..tokenization.qwen2 import Qwen2Tokenizer
from ..training import family_parts as S
from .conditioning import DROP_TOKENS, PROMPT_TEMPLATE, TOKENIZER_MAX_LENGTH, prompt_embeds_from_states
from .params import qwen_image_params

TINY = "qwen-image-tiny"
TEXT_LENGTH = {TINY: 32}
DEFAULT_TEXT_LENGTH = 512          # QwenImagePipeline's max_sequence_length
QWEN_VOCAB = 151643                # Qwen2's BPE vocabulary (the special tokens follow)
SUBFOLDERS = {"vae": "vae", "text_encoder": "text_encoder", "tokenizer": "tokenizer"}


def _size(model_cfg):
    return model_cfg.size or TINY


def text_length(model_cfg):
    return TEXT_LENGTH.get(_size(model_cfg), DEFAULT_TEXT_LENGTH) if model_cfg.name_or_path is None \
        else DEFAULT_TEXT_LENGTH


def _folder(model_cfg, part):
    root = model_cfg.name_or_path
    return os.path.join(root, SUBFOLDERS[part]) if root and os.path.isdir(root) else None


def _vae_path(model_cfg):
    return model_cfg.vae_path or _folder(model_cfg, "vae")


def problems(cfg, *, vae, text, prefix=""):
    """What is missing among the files a run needs (vae: the VAE; text: text encoder and tokenizer)."""
    m, p, e = cfg.model, prefix, []
    if m.name_or_path is None:
        return [f"{p}model.vae_path: model.size {_size(m)} builds random parts; give model.name_or_path for files"] \
            if m.vae_path is not None else []
    if vae:
        where = _vae_path(m)
        if where is None or not os.path.exists(where):
            e.append(f"{p}model.vae_path: the VAE: {m.name_or_path} is not a QwenImagePipeline folder with vae/; "
                     f"set model.vae_path (a diffusers AutoencoderKLQwenImage folder)")
    if text:
        for part in ("text_encoder", "tokenizer"):
            where = _folder(m, part)
            if where is None or not os.path.isdir(where):
                e.append(f"{p}model.name_or_path: the {part.replace('_', ' ')}: {m.name_or_path} is not a "
                         f"QwenImagePipeline folder with {part}/ (its Qwen2.5-VL {part.replace('_', ' ')})")
    return e


# ----------------------------------------------------------------------------- the VAE
def vae_id(model_cfg, device):
    return S.vae_id("qwen_image", model_cfg, _size(model_cfg), device,
                    lambda: S.identity(_vae_path(model_cfg), "vae"))


def load_vae(model_cfg, device):
    """The VAE: the analytic pooling VAE for the tiny preset, a random AutoencoderKLQwenImage for the released size
    without files, else load_vae of the folder's vae/ (or model.vae_path)."""
    from .vae import AutoencoderKLQwenImage
    from .vae import load_vae as load
    if model_cfg.name_or_path is None:
        if _size(model_cfg) == TINY:
            from ..training.analytic_vae import analytic_vae
            return analytic_vae(device=device, z_channels=16)
        with flame_nn.empty_init(device=device, dtype=S.te_dtype(device)):
            vae = AutoencoderKLQwenImage()
        S.init_random_(vae, flame.Generator(device).manual_seed(S.RANDOM_SEED))
        return vae.requires_grad_(False).eval()
    return load(_vae_path(model_cfg), dtype=S.vae_dtype(device), device=device).requires_grad_(False).eval()


# ----------------------------------------------------------------------------- the text encoder
class QwenImageTextEncoders(EncoderBundle):
    """The Qwen2.5-VL language model with its tokenizer. encode(prompts) -> {"prompt_embeds": (B, L, width),
    "prompt_mask": (B, L)} with L = max_length (see the module docstring); free() releases them."""

    encoder_attrs = ("text_encoder",)
    tokenizer_attrs = ("tokenizer",)

    def __init__(self, text_encoder, tokenizer, *, max_length, drop=None):
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.max_length = int(max_length)
        self.drop = int(drop) if drop is not None else prefix_drop(tokenizer)
        self._runs = {"text_encoder": text_encoder}        # eager: the padded length changes with the captions

    def encode(self, prompts, *, batch_size=None):
        self._check_alive()
        texts = [PROMPT_TEMPLATE.format(p) for p in prompt_list(prompts)]
        ids, mask = self.tokenizer(texts, max_length=TOKENIZER_MAX_LENGTH + self.drop)
        dev = self.text_encoder.embed_tokens.weight.device
        with flame.no_grad():
            out = self.text_encoder(flame.tensor(ids, device=dev), attention_mask=flame.tensor(mask, device=dev),
                                    output_hidden_states=True)
        embeds, pmask = prompt_embeds_from_states(out.hidden_states[-1], mask, self.max_length, self.drop)
        B, n, D = embeds.shape
        full = np.zeros((B, self.max_length, D), np.float32)
        full_mask = np.zeros((B, self.max_length), np.float32)
        full[:, :n], full_mask[:, :n] = embeds, pmask
        return {"prompt_embeds": flame.tensor(full, device=dev), "prompt_mask": flame.tensor(full_mask, device=dev)}

    def free(self):
        """Drop the text encoder and return its memory now (device pool, a streamer's pinned buffers)."""
        if self._runs is None:
            return
        self._runs = {}                                  # (eager: no CUDA graph to reset)
        super().free()


def tiny_tokenizer():
    """The tiny preset's stand-in tokenizer: byte-level BPE (Qwen2's pre-tokenizer) learned from the tiny corpus and
    the prompt template, with Qwen's three special tokens after its 400 tokens."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    from ..tokenization.qwen2 import PATTERN
    from ..tokenization.tiny_corpus import TINY_CORPUS
    tok = Tokenizer(BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PROMPT_TEMPLATE.format(c) for c in TINY_CORPUS], trainer)
    return Qwen2Tokenizer(tok, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])


def _sections(head_dim):
    """M-RoPE sections (time, height, width) over head_dim / 2 frequency slots, in the released ratio 16:24:24
    rounded (text rotates the same whatever the split)."""
    half = head_dim // 2
    h = w = (3 * half) // 8
    return (half - h - w, h, w)


def prefix_drop(tokenizer):
    """The template tokens dropped before the prompt's: the pipeline's 34 for Qwen's own vocabulary (151643 tokens
    and up); for a smaller (test) vocabulary, however many tokens it makes of the template's prefix."""
    return DROP_TOKENS if len(tokenizer) >= QWEN_VOCAB else template_prefix_tokens(tokenizer)


def template_prefix_tokens(tokenizer):
    """How many tokens `tokenizer` makes of the template before the prompt (34 for Qwen's own)."""
    return len(tokenizer.encode(PROMPT_TEMPLATE.split("{}")[0]))


def _te_params(model_cfg):
    """Parameters of the language model that encodes (embeddings, layers, norm; not the vision tower nor lm_head):
    from the folder's headers, or the random preset's size."""
    if model_cfg.name_or_path is None:  # the tiny preset's stand-in is small; the released size's is the 7B model
        return 0 if _size(model_cfg) == TINY else released_te_params()
    shapes = F.read_headers(F.part_files(model_cfg.name_or_path, "text_encoder", subfolders=SUBFOLDERS))
    n = 0
    for k, shape in shapes.items():
        if "visual." in k or k.startswith("lm_head."):
            continue
        c = 1
        for d in shape:
            c *= d
        n += c
    return n


def released_te_params():
    """Parameters of the released Qwen2.5-VL-7B language model (embeddings, 28 layers, final norm): 7.07e9."""
    from ..text_encoders.qwen2_5_vl import Qwen2_5_VLTextConfig
    c = Qwen2_5_VLTextConfig()
    kv = c.num_key_value_heads * c.head_dim
    attn = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + c.hidden_size + 2 * kv  # q, o; k, v; biases
    layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return c.vocab_size * c.hidden_size + c.num_hidden_layers * layer + c.hidden_size


def te_storage(model_cfg, device, budget):
    """'bf16' | 'fp8' | 'fp8+stream' ('float32' / 'fp8' on the cpu): how Qwen2.5-VL is held while captions are
    encoded -- as T5's (training.family_parts.t5_storage): fp8 when model.quantize_te asks or when max_gpu_memory
    cannot hold it in bfloat16 with a margin, its layers streamed when even fp8 does not fit."""
    return S.t5_storage(lambda: _te_params(model_cfg), model_cfg.quantize_te, device, budget)


def te_loading(storage):
    """(quantize, stream) for load_qwen2_5_vl / place_qwen2_5_vl from a te_storage answer."""
    return ("fp8" if storage.startswith("fp8") else None), storage.endswith("stream")


def text_id(model_cfg, device, budget=None):
    m = model_cfg
    storage = te_storage(m, device, budget)
    how = f"{S.te_dtype(device)}|qwen2.5-vl|{text_length(m)}" + ("|fp8" if storage.startswith("fp8") else "")
    return S.cache_id("qwen-image-te", m, _size(m), how,
                      lambda: f"{S.identity(_folder(m, 'text_encoder'), 'text_encoder')}|tok:"
                              f"{os.path.abspath(_folder(m, 'tokenizer'))}")


def describe(model_cfg, device, budget=None):
    return f"Qwen2.5-VL ({te_storage(model_cfg, device, budget)}, {text_length(model_cfg)} tokens, padding masked)"


def _draw_layerwise(te, dev, quantize, stream, place):
    """Random values for an empty_init language model, one layer at a time on `dev`, each layer stored as it will be
    held before the next is drawn (fp8 in place; moved to host memory for the streamer): the released 7B model in
    bfloat16 (14 GB) never has to fit the budget whole."""
    from flame_nn.offload import quantize_linear_weights_
    g = flame.Generator(dev).manual_seed(S.RANDOM_SEED)
    S.init_random_(te.embed_tokens, g)
    S.init_random_(te.norm, g)
    for layer in te.layers:
        S.init_random_(layer, g)
        if stream:
            layer.to("cpu")
        elif quantize:
            quantize_linear_weights_(layer)
    if stream:
        place(te, dev, quantize=quantize, stream=True)
    return te


def load_text_encoders_for(model_cfg, device, budget=None):
    """QwenImageTextEncoders: random stand-ins without files (see the module docstring), else the folder's
    text_encoder/ and tokenizer/; the language model held as te_storage says (fp8 layers, streamed layers)."""
    from ..text_encoders.qwen2_5_vl import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        load_qwen2_5_vl,
        place_qwen2_5_vl,
    )
    dev = flame.device(device)
    quantize, stream = te_loading(te_storage(model_cfg, dev, budget))
    if model_cfg.name_or_path is None:
        size = _size(model_cfg)
        if size == TINY:
            tok = tiny_tokenizer()
            width = qwen_image_params(size).joint_attention_dim
            config = Qwen2_5_VLTextConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          mrope_section=_sections(width // 4))
        else:  # the released language model at random, the stand-in tokenizer (see the module docstring)
            tok = tiny_tokenizer()
            config = Qwen2_5_VLTextConfig()
        with flame_nn.empty_init(device=dev, dtype=S.te_dtype(dev)):
            te = Qwen2_5_VLTextModel(config)
        _draw_layerwise(te.requires_grad_(False), dev, quantize, stream, place_qwen2_5_vl)
        return QwenImageTextEncoders(te.eval(), tok, max_length=text_length(model_cfg))
    te = load_qwen2_5_vl(_folder(model_cfg, "text_encoder"), dtype=S.te_dtype(dev), device=dev, quantize=quantize,
                         stream=stream)
    tok = Qwen2Tokenizer.from_folder(_folder(model_cfg, "tokenizer"))
    return QwenImageTextEncoders(te.requires_grad_(False).eval(), tok, max_length=text_length(model_cfg))
