"""A tiny random Chroma model written as a diffusers folder, for tests and for trying the commands without the 18 GB
of Chroma1: model_index.json (ChromaPipeline), transformer/ (ChromaTransformer2DModel names, the chroma-tiny preset
32 wide in text), vae/ (the tiny Flux-shaped VAE), text_encoder/ (a 2-layer T5 32 wide), tokenizer/ (T5
SentencePiece learned from the tiny corpus). Same seed, same files."""
import os

import flame_core as flame

from ..bfl.tiny import T5_WIDTH, TINY_VAE, save_vae_folder, tiny_t5
from ..checkpoint_io import write_json
from ..tokenization import T5Tokenizer
from ..tokenization.tiny_corpus import TINY_CORPUS
from ..vae import AutoencoderKL
from .components import find_chroma_files
from .loading import save_chroma
from .model import Chroma
from .params import configs


def tiny_chroma_parts(seed=0, *, corpus=None):
    """{"transformer", "vae", "t5", "t5_tokenizer"} with random weights from `seed` (float32, cpu); the global random
    state is left as it was."""
    corpus = list(TINY_CORPUS if corpus is None else corpus)
    tok = T5Tokenizer.train_tiny(corpus, vocab_size=120, model_max_length=512)
    state = flame.random.get_rng_state("cpu")
    try:
        flame.manual_seed(seed)
        t5 = tiny_t5(tok)
        transformer = Chroma(configs["chroma-tiny"].replace(context_in_dim=T5_WIDTH), device="cpu")
        vae = AutoencoderKL(TINY_VAE, device="cpu")
    finally:
        flame.random.set_rng_state(state, "cpu")
    for m in (t5, transformer, vae):
        m.requires_grad_(False)
        m.eval()
    return {"transformer": transformer, "vae": vae, "t5": t5, "t5_tokenizer": tok}


def tiny_chroma_files(folder, seed=0, *, corpus=None):
    """Write a tiny random Chroma model as a diffusers folder at `folder`; returns its ChromaFiles."""
    parts = tiny_chroma_parts(seed, corpus=corpus)
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    save_chroma(parts["transformer"], os.path.join(folder, "transformer"), layout="diffusers")
    save_vae_folder(parts["vae"], os.path.join(folder, "vae"))
    parts["t5"].save_pretrained(os.path.join(folder, "text_encoder"))
    parts["t5_tokenizer"].save_pretrained(os.path.join(folder, "tokenizer"))
    write_json(os.path.join(folder, "model_index.json"), {
        "_class_name": "ChromaPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "ChromaTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]},
        sort_keys=True)
    return find_chroma_files(folder)
