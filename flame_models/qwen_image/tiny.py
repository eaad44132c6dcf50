"""A tiny random Qwen-Image written as a diffusers-style QwenImagePipeline folder, for tests and for trying the
commands without the 57 GB of the release: model_index.json, transformer/ (the qwen-image-tiny preset in diffusers'
names), vae/ (a base-8 AutoencoderKLQwenImage in FLAME's single-frame layout: FLAME reads it, diffusers does not),
text_encoder/ (a 2-layer Qwen2.5-VL text model 48 wide, transformers' names and config), tokenizer/ (the tiny
preset's BPE learned from the tiny corpus). Same seed, same files. Random weights: the images are noise."""
import json
import os

import flame_core as flame
from flame_core import io

from ..checkpoint_io import write_json
from .family_parts import _sections, tiny_tokenizer
from .loading import save_qwen_image
from .model import QwenImageTransformer2DModel
from .params import qwen_image_params
from .vae import AutoencoderKLQwenImage, QwenImageVAEConfig, save_vae

TINY_VAE = QwenImageVAEConfig(base_dim=8, num_res_blocks=1)


def tiny_qwen_image_folder(path, seed=0):
    """Write the folder at `path` (created); returns `path`."""
    from ..text_encoders.qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    flame.manual_seed(seed)
    p = qwen_image_params("qwen-image-tiny")
    save_qwen_image(QwenImageTransformer2DModel(p, dtype=flame.float32, device="cpu"), os.path.join(path,
                                                                                                   "transformer"))
    save_vae(AutoencoderKLQwenImage(TINY_VAE, dtype=flame.float32, device="cpu"), os.path.join(path, "vae"))
    tok = tiny_tokenizer()
    tok_dir = os.path.join(path, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok.tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    write_json(os.path.join(tok_dir, "tokenizer_config.json"), {
        "tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(tok.tokenizer.token_to_id(t)): {"content": t, "special": True}
                                 for t in specials}})
    W = p.joint_attention_dim
    c = Qwen2_5_VLTextConfig(vocab_size=len(tok), hidden_size=W, intermediate_size=2 * W, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, mrope_section=_sections(W // 4))
    te = Qwen2_5_VLTextModel(c, dtype=flame.float32, device="cpu")
    te_dir = os.path.join(path, "text_encoder")
    os.makedirs(te_dir, exist_ok=True)
    io.save_file({"model." + k: v.detach() for k, v in te.named_parameters()},
                 os.path.join(te_dir, "model.safetensors"))
    write_json(os.path.join(te_dir, "config.json"), {
        "model_type": "qwen2_5_vl", "vocab_size": c.vocab_size, "hidden_size": W, "intermediate_size": 2 * W,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": {"type": "mrope", "mrope_section": list(c.mrope_section)}})
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump({"_class_name": "QwenImagePipeline", "_diffusers_version": "0.42.1"}, f)
    return path
