"""A tiny random Flux text-to-image model written as a diffusers folder: for tests, the built-in demo and trying the
generation command without downloading 30 GB.

    files = tiny_flux_files("tiny_flux/", seed=0)        # FluxFiles; the folder reads like FLUX.1-dev/
    # python -m flame_models.generate --model tiny_flux/ --prompt "a red square" --width 64 --height 64

Layout (diffusers FluxPipeline): model_index.json, transformer/ (FluxTransformer2DModel names), vae/ (AutoencoderKL),
text_encoder/ (CLIPTextModel), text_encoder_2/ (T5EncoderModel), tokenizer/ (CLIP BPE: vocab.json + merges.txt),
tokenizer_2/ (T5 SentencePiece). The tokenizers are learned from `corpus` (deterministic); every weight is drawn from
`seed`. Widths: CLIP 32 (-> vec_in_dim), T5 32 (-> context_in_dim), transformer flux-tiny (64 wide, 2 + 2 blocks),
VAE 8..32 channels with Flux's 16 latent channels and 8x downsampling.
"""
import json
import os

import flame_core as flame

from ..checkpoint_io import write_json
from ..text_encoders import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
from ..tokenization import CLIPTokenizer, T5Tokenizer
from ..tokenization.tiny_corpus import TINY_CORPUS
from ..vae import AutoencoderKL, VAEConfig, save_vae
from .components import find_flux_files
from .loading import save_flux
from .model import Flux
from .params import configs

CLIP_WIDTH = 32
T5_WIDTH = 32
TINY_VAE = VAEConfig(ch=8, ch_mult=(1, 2, 4, 4), num_res_blocks=1, z_channels=16, norm_num_groups=4, sample_size=64)


def tiny_t5(tokenizer):
    """A 2-layer T5 encoder T5_WIDTH wide for `tokenizer`'s vocabulary (random: draws from the global generator)."""
    return T5EncoderModel(T5Config(vocab_size=tokenizer.vocab_size, d_model=T5_WIDTH, d_kv=8, d_ff=48, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16),
                          device="cpu")


def save_vae_folder(vae, vae_dir):
    """Write the Flux-shaped `vae` as a diffusers vae/ folder with Flux's latent scale and shift in its config.json
    (what diffusers' FluxPipeline / ChromaPipeline read)."""
    save_vae(vae, vae_dir, layout="diffusers")
    with open(os.path.join(vae_dir, "config.json")) as f:
        vae_cfg = json.load(f)
    vae_cfg.update(scaling_factor=0.3611, shift_factor=0.1159)
    write_json(os.path.join(vae_dir, "config.json"), vae_cfg, sort_keys=True)


def tiny_flux_parts(seed=0, *, corpus=None, guidance_embed=True):
    """The tiny parts in memory: {"transformer", "vae", "clip_l", "t5", "clip_tokenizer", "t5_tokenizer"}, random
    weights from `seed` (float32, cpu). The global random state is left as it was."""
    corpus = list(TINY_CORPUS if corpus is None else corpus)
    clip_tok = CLIPTokenizer.train_tiny(corpus, vocab_size=600)
    t5_tok = T5Tokenizer.train_tiny(corpus, vocab_size=120, model_max_length=512)
    state = flame.random.get_rng_state("cpu")
    try:
        flame.manual_seed(seed)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=clip_tok.vocab_size, hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH,
            projection_dim=CLIP_WIDTH, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
            hidden_act="quick_gelu", bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id), device="cpu")
        t5 = tiny_t5(t5_tok)
        params = configs["flux-tiny"].replace(vec_in_dim=CLIP_WIDTH, context_in_dim=T5_WIDTH,
                                              guidance_embed=guidance_embed)
        transformer = Flux(params, device="cpu")
        vae = AutoencoderKL(TINY_VAE, device="cpu")
    finally:
        flame.random.set_rng_state(state, "cpu")
    for m in (clip, t5, transformer, vae):
        m.requires_grad_(False)
        m.eval()
    return {"transformer": transformer, "vae": vae, "clip_l": clip, "t5": t5, "clip_tokenizer": clip_tok,
            "t5_tokenizer": t5_tok}


def save_flux_folder(folder, parts):
    """Write parts (as tiny_flux_parts returns them) as a diffusers Flux folder; returns its FluxFiles."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    save_flux(parts["transformer"], os.path.join(folder, "transformer"), layout="diffusers")
    save_vae_folder(parts["vae"], os.path.join(folder, "vae"))
    parts["clip_l"].save_pretrained(os.path.join(folder, "text_encoder"))
    parts["t5"].save_pretrained(os.path.join(folder, "text_encoder_2"))
    parts["clip_tokenizer"].save_pretrained(os.path.join(folder, "tokenizer"))
    parts["t5_tokenizer"].save_pretrained(os.path.join(folder, "tokenizer_2"))
    write_json(os.path.join(folder, "model_index.json"), {
        "_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}, sort_keys=True)
    return find_flux_files(folder)


def tiny_flux_files(folder, seed=0, *, corpus=None, guidance_embed=True):
    """Write a tiny random Flux model (dev-like with guidance_embed, else schnell-like) as a diffusers folder at
    `folder`; returns its FluxFiles. Same seed and corpus, same files."""
    return save_flux_folder(folder, tiny_flux_parts(seed, corpus=corpus, guidance_embed=guidance_embed))
