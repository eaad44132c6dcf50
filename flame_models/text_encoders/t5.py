"""The T5 v1.1 encoder (transformers' T5EncoderModel): a shared token embedding, blocks of [RMS norm -> self-attention
without 1/sqrt(d) scaling, plus a bucketed relative position bias] and [RMS norm -> gated GELU(tanh) feed-forward],
a final RMS norm. Parameter names are transformers' keys (`shared.weight`, `encoder.block.0.layer.0.SelfAttention.q
.weight`, `encoder.block.0.layer.1.DenseReluDense.wi_0.weight`, `encoder.final_layer_norm.weight`).

The position bias is computed once per forward, in block 0 (whose `relative_attention_bias` holds the table), with
the padding mask folded in (MASKED at padded keys), as one float32 (1 or B, heads, L, L) additive attention mask that
every block's fused attention reads; the bucket of each (query, key) pair is computed on the host once per length and
kept on the device.

Blocks run through `flame_nn.offload.run_block`, so a BlockStreamer on `encoder.block` streams them
(`load_t5(..., stream=True)`). In float16 the residual stream follows transformers: `wo` is loaded in float32 by
`load_t5` (so the stream becomes float32 after the first feed-forward), and a float16 stream is clamped to the
float16 range after each sub-layer.
"""
import math

import numpy as np

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_nn.offload import is_streamed, run_block

from .base import TextEncoderModel
from .configs import T5Config
from .inputs import padding_mask, token_ids
from .outputs import BaseModelOutput
from .storage import project_heads

_FP16_MAX = 65504.0
# added at padded keys: finite (unlike -inf, a block of keys that are all padding cannot turn an online softmax's
# running maximum into -inf - -inf), yet exp() of it is 0; even scaled by log2(e) it stays inside float32. A sample
# that is all padding then attends uniformly, as transformers' finfo.min does.
MASKED = -1e30


def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
    """transformers' bidirectional bucket of each relative position (key - query) (NumPy ints -> ints): half the
    buckets per direction, the first half of those exact, the rest logarithmic up to max_distance, then the last."""
    rp = np.asarray(relative_position, dtype=np.int64)
    n = num_buckets // 2
    bucket = (rp > 0).astype(np.int64) * n
    a = np.abs(rp)
    max_exact = n // 2
    with np.errstate(divide="ignore"):
        large = max_exact + (np.log(np.maximum(a, 1) / max_exact) / math.log(max_distance / max_exact)
                             * (n - max_exact))
    large = np.minimum(large.astype(np.int64), n - 1)
    return bucket + np.where(a < max_exact, a, large)


def _clamp_fp16(x):
    """transformers' fp16 guard: clamp to +-65504, or to +-64504 once an inf appeared (decided on the GPU)."""
    if x.dtype != flame.float16:
        return x
    limit = x.isinf().any().float() * -1000.0 + _FP16_MAX                    # 0-d, stays on the device
    return flame.minimum(flame.maximum(x, -limit), limit)


def _compute_dtype(linear):
    """The dtype a Linear computes in (an fp8-stored one keeps its original dtype as `compute_dtype`)."""
    return getattr(linear, "compute_dtype", None) or linear.weight.dtype


class T5LayerNorm(flame_nn.RMSNorm):
    """RMS norm without bias or mean subtraction (flame_nn.RMSNorm's gain), statistics in float32; the result in the
    weight's dtype, also for an input of another dtype."""

    def __init__(self, hidden_size, eps=1e-6, dtype=None, device=None):
        super().__init__(hidden_size, eps=eps, dtype=dtype, device=device)

    def forward(self, x):
        w = self.weight
        if x.dtype == w.dtype:
            return F.rms_norm(x, (x.shape[-1],), w, eps=self.eps)
        y = F.rms_norm(x, (x.shape[-1],), None, eps=self.eps)  # a float32 stream, float16 weights
        return w * y.to(w.dtype)


class T5Attention(flame_nn.Module):
    fusable_projections = ("q", "k", "v")  # one matmul when loaded packed (see storage.py)
    fused_projections = None

    def __init__(self, config, has_relative_attention_bias=False, dtype=None, device=None):
        super().__init__()
        self.num_heads, self.d_kv = config.num_heads, config.d_kv
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q = flame_nn.Linear(config.d_model, config.inner_dim, **kw)
        self.k = flame_nn.Linear(config.d_model, config.inner_dim, **kw)
        self.v = flame_nn.Linear(config.d_model, config.inner_dim, **kw)
        self.o = flame_nn.Linear(config.inner_dim, config.d_model, **kw)
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            self.relative_attention_bias = flame_nn.Embedding(self.num_buckets, self.num_heads, dtype=dtype,
                                                              device=device)
        self._buckets = {}  # (length, device) -> (L, L) bucket table on the device

    def compute_bias(self, length, attention_mask=None):
        """The (1, heads, L, L) position bias (float32, or the table's dtype when wider); with a (B, L) bool padding
        mask, (B, heads, L, L) with MASKED at padded keys."""
        table = self.relative_attention_bias.weight
        key = (length, str(table.device))
        buckets = self._buckets.get(key)
        if buckets is None:
            if len(self._buckets) >= 8:  # captions of many lengths: keep the latest few tables
                self._buckets.pop(next(iter(self._buckets)))
            pos = np.arange(length)
            rel = relative_position_bucket(pos[None, :] - pos[:, None], self.num_buckets, self.max_distance)
            buckets = self._buckets[key] = flame.tensor(rel, device=table.device)
        bias = table[buckets].permute(2, 0, 1)[None]                                       # (1, heads, L, L)
        if bias.dtype.itemsize < 4:
            bias = bias.float()  # the attention kernels take an additive mask in float32
        if attention_mask is not None:
            bias = flame.where(attention_mask[:, None, None, :], bias, MASKED)            # (B, heads, L, L)
        return bias.contiguous()

    def forward(self, x, position_bias):
        B, L, _ = x.shape
        trained_bias = position_bias.requires_grad and flame.is_grad_enabled()
        fused = self.fused_projections
        qkv = fused(x) if fused is not None and not trained_bias else None                # (B, L, 3 inner) or None
        if qkv is not None:  # heads split and merged inside the attention op: 2 ops, not 9
            return self.o(F.qkv_attention(qkv, self.num_heads, attn_mask=position_bias, scale=1.0))
        q, k, v = project_heads(self, x, self.num_heads, self.d_kv)                       # (B, heads, L, d_kv)
        if trained_bias:
            # the fused attention gives no gradient to an additive mask: a trained bias table takes the plain form
            p = (q @ k.transpose(-1, -2) + position_bias).softmax(-1)                   # (B, heads, L, L)
            o = p.to(v.dtype) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=position_bias, scale=1.0)  # no 1/sqrt(d) in T5
        return self.o(o.transpose(1, 2).reshape(B, L, self.num_heads * self.d_kv))


class T5LayerSelfAttention(flame_nn.Module):
    def __init__(self, config, has_relative_attention_bias=False, dtype=None, device=None):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias, dtype=dtype, device=device)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype, device=device)

    def forward(self, x, position_bias=None, attention_mask=None):
        if position_bias is None:
            position_bias = self.SelfAttention.compute_bias(x.shape[1], attention_mask)
        return x + self.SelfAttention(self.layer_norm(x), position_bias), position_bias


class T5DenseGatedActDense(flame_nn.Module):
    fusable_projections = ("wi_0", "wi_1")  # one matmul when loaded packed, its [gate | a] halves into one GEGLU
    fused_projections = None

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.wi_0 = flame_nn.Linear(config.d_model, config.d_ff, **kw)
        self.wi_1 = flame_nn.Linear(config.d_model, config.d_ff, **kw)
        self.wo = flame_nn.Linear(config.d_ff, config.d_model, **kw)

    def forward(self, x):
        fused = self.fused_projections
        gi = fused(x) if fused is not None else None                          # [wi_0 x | wi_1 x] or None
        if gi is None:  # the layers one by one (a streamed block, a trained layer): laid out as the stacked
            # projection's output, so that GEGLU rounds as there and streaming does not change the numbers
            gi = flame.cat([self.wi_0(x), self.wi_1(x)], dim=-1)
        h = F.geglu(gi, approximate="tanh", gate_first=True)  # gelu_new(wi_0 x) * wi_1 x, each value rounded once
        wo_dtype = _compute_dtype(self.wo)
        return self.wo(h if h.dtype == wo_dtype else h.to(wo_dtype))


class T5LayerFF(flame_nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(config, dtype=dtype, device=device)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype, device=device)

    def forward(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(flame_nn.Module):
    """(hidden (B, L, d_model), position_bias or None, padding mask for block 0) -> (hidden, position_bias)."""
    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, config, has_relative_attention_bias=False, dtype=None, device=None):
        super().__init__()
        self.layer = flame_nn.ModuleList([
            T5LayerSelfAttention(config, has_relative_attention_bias, dtype=dtype, device=device),
            T5LayerFF(config, dtype=dtype, device=device)])

    def forward(self, x, position_bias=None, attention_mask=None, h=None, next_norm=None):
        """The plain form returns (x, position_bias). Chained (T5Stack, blocks run as plain calls): h is
        layer[0]'s norm of x when the caller has it (the previous block's last add fused with this norm) and
        next_norm the norm after this block, fused with its last add -> (x, position_bias, next_norm(x)); each
        residual add runs with the norm after it as one op (F.add_rms_norm) where add_norm can fuse them."""
        if h is None and next_norm is None:
            x, position_bias = self.layer[0](x, position_bias, attention_mask)
            x = _clamp_fp16(x)
            x = _clamp_fp16(self.layer[1](x))
            return x, position_bias
        sa, ff = self.layer[0], self.layer[1]
        if position_bias is None:
            position_bias = sa.SelfAttention.compute_bias(x.shape[1], attention_mask)
        h = sa.layer_norm(x) if h is None else h
        x, h = add_norm(x, sa.SelfAttention(h, position_bias), ff.layer_norm)
        x, h = add_norm(x, ff.DenseReluDense(h), next_norm)
        return x, position_bias, h


def add_norm(x, r, norm):
    """(x + r, norm(x + r)) with the sum clamped as the plain blocks clamp it: one fused op (F.add_rms_norm, the same
    numbers) for a T5LayerNorm without hooks whose weight has the stream's dtype, outside float16 (whose clamp
    comes between the add and the norm); else the add, the clamp and the module call."""
    w = norm.weight
    if (type(norm) is T5LayerNorm and not norm.has_hooks() and x.dtype == r.dtype == w.dtype
            and x.dtype != flame.float16):
        return F.add_rms_norm(x, r, w, norm.eps)
    x = _clamp_fp16(x + r)
    return x, norm(x)


class T5Stack(flame_nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.block = flame_nn.ModuleList(T5Block(config, i == 0, dtype=dtype, device=device)
                                         for i in range(config.num_layers))
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype,
                                            device=device)

    def forward(self, x, attention_mask=None, output_hidden_states=False):
        hidden_states = [x] if output_hidden_states else None
        position_bias = None
        blocks, n = self.block, len(self.block)
        # each block's residual adds fused with the norms after them where the blocks run as plain calls; streamed or
        # checkpointed blocks stay whole (a block's weights are only there in its turn, a recomputed block must not
        # reach into the next), and sub-layers with hooks run as modules (the chained form does not call them)
        chain = n > 0 and not is_streamed(blocks) and not any(
            b.gradient_checkpointing or b.layer[0].has_hooks() or b.layer[1].has_hooks() for b in blocks)
        h = None
        for i in range(n):
            if chain:
                nxt = blocks[i + 1].layer[0].layer_norm if i + 1 < n else self.final_layer_norm
                x, position_bias, h = blocks[i](x, position_bias, attention_mask if i == 0 else None, h=h,
                                                next_norm=nxt)
            else:
                x, position_bias = run_block(blocks, i, x, position_bias, attention_mask if i == 0 else None)
            if hidden_states is not None:
                hidden_states.append(x)
        x = h if chain else self.final_layer_norm(x)
        if hidden_states is not None:
            hidden_states[-1] = x  # transformers: the last entry is the normed last_hidden_state
        return x, hidden_states


class T5EncoderModel(TextEncoderModel):
    """transformers' T5EncoderModel. Build under `flame_nn.empty_init` and load with `load_t5` for real weights.

    A tiny one at run time: `T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
    num_heads=4))`."""

    def __init__(self, config, *, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, T5Config):
            config = T5Config.from_dict(config)
        self.config = config
        self.shared = flame_nn.Embedding(config.vocab_size, config.d_model, dtype=dtype, device=device)
        self.encoder = T5Stack(config, dtype=dtype, device=device)
        self.streamer = None  # the BlockStreamer of encoder.block, when load_t5(stream=True) made one

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        """input_ids (B, L) int; attention_mask (B, L) 1 = token, 0 = padding (optional) ->
        BaseModelOutput(last_hidden_state (B, L, d_model), hidden_states)."""
        table = self.shared.weight
        ids = token_ids(input_ids, vocab_size=self.config.vocab_size, device=table.device, model="T5EncoderModel")
        keep = padding_mask(attention_mask, ids, device=table.device, model="T5EncoderModel")
        last, hidden_states = self.encoder(table[ids], keep, output_hidden_states)
        return BaseModelOutput(last_hidden_state=last,
                               hidden_states=tuple(hidden_states) if hidden_states is not None else None)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """load_t5 (see there for the layouts and the quantize / stream options)."""
        from .loading import load_t5
        return load_t5(path, dtype=dtype, device=device, **kwargs)

    def get_input_embeddings(self):
        return self.shared

    def checkpointed_blocks(self):
        return list(self.encoder.block)
