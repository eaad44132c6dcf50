"""Shared by tests/models/test_sd3_*.py: the golden fixtures of tests/fixtures/make_sd3_fixtures.py (diffusers'
SD3Transformer2DModel on tiny random configs) and small helpers."""
import json
from pathlib import Path

import numpy as np

import flame_core as flame
from flame_core.io import load_file
from flame_models.sd3 import SD3Params

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sd3"
VARIANTS = ("plain", "dual")


def meta(variant):
    return json.loads((FIXTURES / variant / "meta.json").read_text())


def io(variant):
    """The fixture's inputs and outputs as float32 / float64 NumPy arrays."""
    return {k: t.numpy() for k, t in load_file(FIXTURES / variant / "io.safetensors").items()}


def diffusers_dir(variant):
    return FIXTURES / variant / "transformer"


def sai_file(variant):
    return FIXTURES / variant / "sai.safetensors"


def params(variant):
    """The fixture's config as SD3Params (what load_sd3 must infer, and what the plain SAI file needs passed)."""
    c = meta(variant)["config"]
    return SD3Params(in_channels=c["in_channels"], out_channels=c["out_channels"], patch_size=c["patch_size"],
                     hidden_size=c["num_attention_heads"] * c["attention_head_dim"],
                     num_heads=c["num_attention_heads"], depth=c["num_layers"],
                     context_in_dim=c["joint_attention_dim"], pooled_in_dim=c["pooled_projection_dim"],
                     pos_embed_max_size=c["pos_embed_max_size"],
                     dual_attention_layers=tuple(c["dual_attention_layers"]),
                     qk_norm="rms" if c["qk_norm"] == "rms_norm" else None, sample_size=c["sample_size"])


def inputs(arrays, dtype, device, keys=("x", "t", "y", "context")):
    return [flame.tensor(arrays[k], dtype=dtype, device=device) for k in keys]


def npy(t):
    return t.detach().float().numpy() if t.dtype not in (flame.float32, flame.float64) else t.detach().numpy()


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
