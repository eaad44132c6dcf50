"""The language model of Qwen2.5-VL (transformers' Qwen2_5_VLTextModel, the text path of
Qwen2_5_VLForConditionalGeneration), Qwen-Image's text encoder: token embeddings, decoder layers of
RMSNorm -> GQA self-attention (q/k/v with bias, o without; rotate-half RoPE) and RMSNorm -> SwiGLU MLP, a final
RMSNorm. The vision tower is not here: text-to-image never reaches it (Qwen-Image-Edit would).

Text only, the multimodal RoPE's three position rows (time, height, width) are equal, so its sections
(mrope_section) rotate exactly as plain RoPE with position = token index. Padding: the attention is causal and masks
the padded keys; with right padding (the tokenizer's) the valid tokens never see a pad, and their positions are
0, 1, ... whichever convention a transformers version uses for the pads' own positions.

    te = load_qwen2_5_vl("Qwen-Image/", dtype=flame.bfloat16, device="cuda")     # its text_encoder/ folder
    out = te(input_ids, attention_mask=mask, output_hidden_states=True)
    out.hidden_states[-1]        # after the final norm: what QwenImagePipeline takes (= out.last_hidden_state)

    te = load_qwen2_5_vl("Qwen-Image/", device="cuda", quantize="fp8", stream=True)  # the 7B in fp8, streamed

Memory, as T5's (text_encoders.loading): quantize="fp8" stores the decoder layers' Linear weights in fp8 (per-row
float32 scales, dequantised right before each matmul: flame_nn.offload), the embeddings and norms in `dtype`
(≈ 7.6 GB for the 7B instead of 14.1 in bfloat16); stream=True keeps the layers in pinned host memory and streams
them through 2 device slots (`model.streamer`, a BlockStreamer: `.auto_fit(budget, step)` keeps as many resident as
a budget allows). With either, the model is read into host memory and moved (and quantised) one layer at a time, so
it is never whole on the device in its dtype.
"""
import dataclasses
import json
import math
import os
from dataclasses import dataclass

import numpy as np

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_nn.empty_init import new_parameter
from flame_nn.offload import BlockStreamer, quantize_linear_weights_, run_block

from .. import checkpoint_io as CIO
from .outputs import BaseModelOutput

PREFIXES = ("model.language_model.", "model.", "language_model.", "")     # transformers 5 / 4 and ComfyUI / bare
QUANTIZE = (None, "fp8")
STACKS = ("layers",)
CONFIG_METADATA_KEY = "flame.qwen2_5_vl_config"


@dataclass(frozen=True)
class Qwen2_5_VLTextConfig:
    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple = (16, 24, 24)

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"hidden_size {self.hidden_size}, {self.num_attention_heads} heads and "
                             f"{self.num_key_value_heads} KV heads do not divide")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}")

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_transformers(cls, config):
        """From a transformers config dict: Qwen2_5_VLConfig's (its text_config, or the older flat layout) or
        Qwen2_5_VLTextConfig's."""
        c = dict(config.get("text_config") or config)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or config.get("rope_scaling") or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        out = {k: c[k] for k in fields if c.get(k) is not None}
        theta = rope.get("rope_theta", c.get("rope_theta", config.get("rope_theta")))
        if theta is not None:
            out["rope_theta"] = float(theta)
        if rope.get("mrope_section") is not None:
            out["mrope_section"] = tuple(rope["mrope_section"])
        return cls(**out)


QWEN2_5_VL_PRESETS = {"qwen2.5-vl-7b": Qwen2_5_VLTextConfig()}


class Qwen2_5_VLCheckpointError(CIO.CheckpointError, RuntimeError):
    """A Qwen2.5-VL text encoder file with missing, unexpected or misshaped tensors, or an unknown config."""


class RMSNorm(flame_nn.Module):
    """weight * (x in float32 * rsqrt(mean(x^2) + eps)) in x's dtype (transformers' Qwen2RMSNorm)."""

    def __init__(self, dim, eps, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((dim,), dtype, device)
        flame_nn.init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)


def rope_tables(positions, head_dim, theta, dtype):
    """cos, sin (L, head_dim) of rotate-half RoPE for integer positions (L,): angles pos * theta^(-2j/head_dim) in
    float32, the two halves alike, cast to `dtype`."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    ang = np.asarray(positions, np.float32)[:, None] * inv[None].astype(np.float32)
    emb = np.concatenate([ang, ang], axis=-1)
    return flame.tensor(np.cos(emb)).to(dtype), flame.tensor(np.sin(emb)).to(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rot = flame.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(flame_nn.Module):
    def __init__(self, c, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = flame_nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=True, **kw)
        self.k_proj = flame_nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=True, **kw)
        self.v_proj = flame_nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=True, **kw)
        self.o_proj = flame_nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False, **kw)

    def forward(self, x, cos, sin, mask):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, self.head_dim).transpose(1, 2)          # (B, h, L, d)
        k = self.k_proj(x).reshape(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        if rep > 1:                                  # GQA: each KV head serves `rep` query heads, in order
            k = k[:, :, None].expand(B, self.kv_heads, rep, L, self.head_dim).reshape(B, self.heads, L, -1)
            v = v[:, :, None].expand(B, self.kv_heads, rep, L, self.head_dim).reshape(B, self.heads, L, -1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(o.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))


class MLP(flame_nn.Module):
    def __init__(self, c, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device, bias=False)
        self.gate_proj = flame_nn.Linear(c.hidden_size, c.intermediate_size, **kw)
        self.up_proj = flame_nn.Linear(c.hidden_size, c.intermediate_size, **kw)
        self.down_proj = flame_nn.Linear(c.intermediate_size, c.hidden_size, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(flame_nn.Module):
    def __init__(self, c, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.self_attn = Attention(c, **kw)
        self.mlp = MLP(c, **kw)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2_5_VLTextModel(flame_nn.Module):
    """Qwen2_5_VLTextModel(config) (a Qwen2_5_VLTextConfig or a preset name, 'qwen2.5-vl-7b'); parameter names are
    transformers' text-model names (embed_tokens, layers.N.self_attn.q_proj, norm)."""

    def __init__(self, config="qwen2.5-vl-7b", *, dtype=None, device=None):
        super().__init__()
        c = CIO.preset(config, Qwen2_5_VLTextConfig, QWEN2_5_VL_PRESETS, what="Qwen2.5-VL")
        self.config = c
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = flame_nn.Embedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = flame_nn.ModuleList(DecoderLayer(c, **kw) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)

    @property
    def device(self):
        """Where it computes: its embeddings' device (streamed layers come to it)."""
        return self.embed_tokens.weight.device

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        """input_ids (B, L) int; attention_mask (B, L) 1 on tokens, 0 on (right) padding -> BaseModelOutput:
        last_hidden_state (B, L, hidden) after the final norm; hidden_states (with output_hidden_states) as
        transformers gives them: the embeddings, each layer's output but the last, then the final normed one."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, L), got {tuple(input_ids.shape)}")
        B, L = input_ids.shape
        ids = input_ids.numpy() if hasattr(input_ids, "numpy") else np.asarray(input_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids outside the vocabulary [0, {self.config.vocab_size}): "
                             f"{int(ids.min())} .. {int(ids.max())}")
        dev = self.embed_tokens.weight.device
        keep = np.tril(np.ones((L, L), bool))[None, None]                                  # causal
        if attention_mask is not None:
            m = attention_mask.numpy() if hasattr(attention_mask, "numpy") else np.asarray(attention_mask)
            if m.shape != (B, L):
                raise ValueError(f"attention_mask {m.shape} does not fit input_ids {(B, L)}")
            keep = keep & (m != 0)[:, None, None, :]
            empty = ~keep.any(axis=-1, keepdims=True)              # (left padding) a query with no key at all
            keep = keep | (empty & np.eye(L, dtype=bool)[None, None])   # attends itself: its row is unused
        mask = flame.tensor(np.ascontiguousarray(np.broadcast_to(keep, (B, 1, L, L))), device=dev)
        x = self.embed_tokens(flame.tensor(ids.astype(np.int64), device=dev))
        cos, sin = (t.to(dev) for t in rope_tables(np.arange(L), self.config.head_dim, self.config.rope_theta,
                                                   x.dtype))
        states = [x] if output_hidden_states else None
        for i in range(len(self.layers)):
            x = run_block(self.layers, i, x, cos, sin, mask)       # through model.streamer when it streams them
            if output_hidden_states and i < len(self.layers) - 1:
                states.append(x)
        x = self.norm(x)
        if output_hidden_states:
            states.append(x)
        return BaseModelOutput(last_hidden_state=x, hidden_states=None if states is None else tuple(states))


def load_qwen2_5_vl(path, dtype=None, device=None, *, config=None, strict=True, quantize=None, stream=False):
    """The Qwen2.5-VL language model from a transformers folder (Qwen-Image's text_encoder/, config.json + sharded
    safetensors), a pipeline folder, or a single file (ComfyUI's qwen_2.5_vl_7b, transformers' names under
    `model.` / `model.language_model.`; ComfyUI's fp8_scaled file too: w = fp8 * `<layer>.scale_weight`, per tensor
    or per row, dequantised to `dtype`); the vision tower and lm_head tensors are left unread. config: a
    Qwen2_5_VLTextConfig, else FLAME's metadata, the folder's config.json, or the 7B preset for a 3584-wide file.
    quantize (None | "fp8") and stream (False | True): the layers' storage (see the module docstring); the model
    comes back frozen."""
    if quantize not in QUANTIZE:
        raise ValueError(f"load_qwen2_5_vl: quantize must be one of {QUANTIZE}, got {quantize!r}")
    if stream not in (True, False):
        raise ValueError(f"load_qwen2_5_vl: stream must be True or False, got {stream!r}")
    placed = quantize is not None or stream
    dev = flame.device(device) if device is not None else flame.default_device()
    if quantize is not None:  # the layers' Linear weights to fp8 as they are read, quantised on `dev` (kept in host
        # memory for the streamer): the 7B is never whole in its dtype in host or device memory
        with CIO.fp8_on_read(STACKS, device=dev, keep="cpu" if stream else None):
            model = _load(path, dtype, "cpu", config, strict)
    else:
        model = _load(path, dtype, "cpu" if placed else dev, config, strict)
    model.requires_grad_(False)
    return place_qwen2_5_vl(model, dev, quantize=quantize, stream=stream) if placed else model


def place_qwen2_5_vl(model, device, *, quantize=None, stream=False, slots=2):
    """Put a frozen Qwen2_5_VLTextModel (in host memory, or anywhere) on `device` with its layers' Linear weights in
    fp8 (quantize="fp8") and / or its layers streamed (stream=True: `model.streamer`, `slots` device buffers), one
    layer at a time; the embeddings and the final norm go to `device` in their dtype. Returns the model."""
    if quantize not in QUANTIZE:
        raise ValueError(f"place_qwen2_5_vl: quantize must be one of {QUANTIZE}, got {quantize!r}")
    dev = flame.device(device)
    model.requires_grad_(False)       # fp8 storage converts frozen Linears; a streamer holds frozen tensors only
    if stream:
        model.streamer = BlockStreamer.for_model(model, STACKS, device=dev, quantize="fp8" if quantize else None,
                                                 slots=slots)
        return model
    model.embed_tokens.to(dev)
    model.norm.to(dev)
    for layer in model.layers:
        layer.to(dev)
        if quantize:
            quantize_linear_weights_(layer)
    return model


def _load(path, dtype, device, config, strict):
    files = CIO.safetensors_files(path, what="Qwen2.5-VL", error=Qwen2_5_VLCheckpointError,
                                  subfolder="text_encoder")
    with _Checkpoint(files, label=os.fspath(path)) as ckpt:
        prefix = next((p for p in PREFIXES if (p + "embed_tokens.weight") in ckpt.handle_of), None)
        if prefix is None:
            raise Qwen2_5_VLCheckpointError(f"{path}: no embed_tokens.weight under {', '.join(map(repr, PREFIXES))}: "
                                            f"not a Qwen2.5-VL language model")
        ckpt.prefix = prefix
        if config is None:
            meta = ckpt.metadata(CONFIG_METADATA_KEY)
            folder = CIO.read_config_json(os.path.dirname(files[0]), Qwen2_5_VLCheckpointError)
            if meta is not None:
                config = Qwen2_5_VLTextConfig(**json.loads(meta))
            elif folder is not None:
                config = Qwen2_5_VLTextConfig.from_transformers(folder)
            elif ckpt.shape("embed_tokens.weight")[1] == 3584:
                config = QWEN2_5_VL_PRESETS["qwen2.5-vl-7b"]
            else:
                raise Qwen2_5_VLCheckpointError(f"{path}: no config.json and not the 7B's width: pass config=")
        if dtype is None:
            dtype = CIO.compute_dtype(ckpt.stored_dtype("embed_tokens.weight"))
        with flame_nn.empty_init(device=device, dtype=dtype):
            model = Qwen2_5_VLTextModel(config)
        targets = dict(model.named_parameters())
        under = [k[len(prefix):] for k in ckpt.keys() if k.startswith(prefix)]
        ours = [k for k in under if not k.startswith(("visual.", "lm_head.", "model.", "language_model."))]
        missing = [k for k in targets if not ckpt.has(k)]
        unexpected = [k for k in ours if k not in targets]
        misshaped = [f"{k}: {ckpt.shape(k)} in the file, {tuple(t.shape)} in the model" for k, t in targets.items()
                     if ckpt.has(k) and ckpt.shape(k) != tuple(t.shape)]
        CIO.check_mismatch(Qwen2_5_VLCheckpointError, f"cannot load the Qwen2.5-VL text model {ckpt.describe()}:",
                           missing, unexpected, misshaped, strict=strict)
        # ComfyUI's fp8_scaled file: get_like applies each weight's scale (checkpoint_io/scaled_fp8.py)
        return CIO.fill_(model, ckpt.get_like, {k: t for k, t in targets.items() if ckpt.has(k)},
                         desc="loading Qwen2.5-VL", read_stored=CIO.stored_fp8_reader(ckpt))


class _Checkpoint(CIO.SafetensorsCheckpoint):
    error = Qwen2_5_VLCheckpointError
