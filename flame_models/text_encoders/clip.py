"""The CLIP text transformer (transformers' CLIPTextModel / CLIPTextModelWithProjection): token + position
embeddings, pre-LayerNorm layers of causal self-attention and an MLP (quick_gelu for CLIP-L, gelu for CLIP-G/bigG),
a final LayerNorm, the pooled state at the EOS token and, projected, `text_embeds`. Parameter names are transformers'
checkpoint keys (`text_model.encoder.layers.0.self_attn.q_proj.weight`, `text_projection.weight`).

    model = CLIPTextModel(CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4))   # tiny, random weights
    out = model(input_ids, output_hidden_states=True)      # input_ids (B, L) int
    out.last_hidden_state, out.pooler_output, out.hidden_states[-2]
"""
import dataclasses

import numpy as np

import flame_core as flame
import flame_nn
import flame_nn.functional as F
from flame_core.errors import ShapeError
from flame_nn.offload import is_streamed, run_block

from .base import TextEncoderModel
from .configs import CLIPTextConfig
from .inputs import padding_mask, token_ids
from .outputs import BaseModelOutputWithPooling, CLIPTextModelOutput
from .storage import project_heads


class CLIPTextEmbeddings(flame_nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.token_embedding = flame_nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.position_embedding = flame_nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                     dtype=dtype, device=device)

    def forward(self, input_ids):
        # rows of the tables: an index, not F.embedding (whose range check waits for the GPU); the whole position
        # table as it is when the ids fill it (77 tokens: one op fewer)
        pos = self.position_embedding.weight
        L = input_ids.shape[1]
        return self.token_embedding.weight[input_ids] + (pos if L == pos.shape[0] else pos[:L])


class CLIPAttention(flame_nn.Module):
    fusable_projections = ("q_proj", "k_proj", "v_proj")  # one matmul when loaded packed (see storage.py)
    fused_projections = None

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        H = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        kw = dict(dtype=dtype, device=device)
        self.q_proj = flame_nn.Linear(H, H, **kw)
        self.k_proj = flame_nn.Linear(H, H, **kw)
        self.v_proj = flame_nn.Linear(H, H, **kw)
        self.out_proj = flame_nn.Linear(H, H, **kw)

    def forward(self, x, attn_mask=None):
        """x (B, L, H); attn_mask None (causal) or bool (B, 1, L, L), True = attend (causal and padding)."""
        B, L, H = x.shape
        fused = self.fused_projections
        qkv = fused(x) if fused is not None else None                              # (B, L, 3H) or None
        if qkv is not None:  # heads split and merged inside the attention op: 2 ops, not 9
            o = F.qkv_attention(qkv, self.num_heads, attn_mask=attn_mask, is_causal=attn_mask is None)
        else:
            q, k, v = project_heads(self, x, self.num_heads, self.head_dim)       # (B, heads, L, D) each
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
            o = o.transpose(1, 2).reshape(B, L, H)
        return self.out_proj(o)


class CLIPMLP(flame_nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.hidden_act = config.hidden_act
        self.fc1 = flame_nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.fc2 = flame_nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype, device=device)

    def forward(self, x):
        h = self.fc1(x)
        h = F.quick_gelu(h) if self.hidden_act == "quick_gelu" else F.gelu(h)
        return self.fc2(h)


class CLIPEncoderLayer(flame_nn.Module):
    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        H, eps = config.hidden_size, config.layer_norm_eps
        self.self_attn = CLIPAttention(config, dtype=dtype, device=device)
        self.layer_norm1 = flame_nn.LayerNorm(H, eps=eps, dtype=dtype, device=device)
        self.mlp = CLIPMLP(config, dtype=dtype, device=device)
        self.layer_norm2 = flame_nn.LayerNorm(H, eps=eps, dtype=dtype, device=device)

    def forward(self, x, attn_mask=None, h=None, next_norm=None):
        """x (B, L, H) -> x + attn + mlp. h: layer_norm1(x) when the caller has it (the previous layer's last add
        fused with this norm); next_norm: the norm after this layer, fused with its last add -> (x, next_norm(x))."""
        h = self.layer_norm1(x) if h is None else h
        x, h = add_norm(x, self.self_attn(h, attn_mask), self.layer_norm2)
        r = self.mlp(h)
        return x + r if next_norm is None else add_norm(x, r, next_norm)


def add_norm(x, r, norm):
    """(x + r, norm(x + r)): one fused op (F.add_layer_norm, the same numbers) when `norm` is a plain LayerNorm over
    the last dim with no hooks, else the add and the module call."""
    if type(norm) is flame_nn.LayerNorm and len(norm.normalized_shape) == 1 and not norm.has_hooks():
        if norm._meta_check:
            norm._check_materialized()
        return F.add_layer_norm(x, r, norm.weight, norm.bias, norm.eps)
    x = x + r
    return x, norm(x)


class CLIPEncoder(flame_nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.layers = flame_nn.ModuleList(CLIPEncoderLayer(config, dtype=dtype, device=device)
                                          for _ in range(config.num_hidden_layers))


class CLIPTextTransformer(flame_nn.Module):
    """`text_model` of the checkpoints: embeddings, encoder.layers, final_layer_norm."""

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config, dtype=dtype, device=device)
        self.encoder = CLIPEncoder(config, dtype=dtype, device=device)
        self.final_layer_norm = flame_nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype,
                                                   device=device)
        self.base_vocab_size = None   # the vocabulary's size before add_token_vectors appended rows (None: none)

    def add_token_vectors(self, vectors):
        """Append `vectors` (n, hidden_size) to the token table (textual inversion: an embedding's vectors); returns
        their ids, vocab_size .. vocab_size + n - 1 (the model's config becomes a copy with the larger vocab_size).
        The pooled state stays the EOS token's: under the legacy eos_token_id 2 the argmax of the ids leaves the
        appended ids out (ComfyUI and A1111 pool there too; transformers' argmax would land on an appended id)."""
        c, emb = self.config, self.embeddings.token_embedding
        w = emb.weight
        v = vectors if isinstance(vectors, flame.Tensor) else flame.tensor(np.asarray(vectors, np.float32))
        if v.ndim != 2 or v.shape[1] != c.hidden_size or v.shape[0] < 1:
            raise ShapeError(f"token vectors of shape {tuple(v.shape)}: (n, {c.hidden_size}) for this CLIP")
        if self.base_vocab_size is None:
            self.base_vocab_size = c.vocab_size
        first = w.shape[0]
        with flame.no_grad():
            table = flame.cat([w.detach(), v.to(device=w.device, dtype=w.dtype)], dim=0)
        emb.weight = flame_nn.Parameter(table, requires_grad=False)
        emb.num_embeddings = table.shape[0]
        self.config = dataclasses.replace(c, vocab_size=table.shape[0])   # (a copy: the config may be shared)
        return list(range(first, table.shape[0]))

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, *, model="CLIPTextModel"):
        c = self.config
        table = self.embeddings.token_embedding.weight
        ids = token_ids(input_ids, vocab_size=c.vocab_size, device=table.device, model=model)
        B, L = ids.shape
        if L > c.max_position_embeddings:
            raise ValueError(f"{model}: {L} tokens, more than max_position_embeddings {c.max_position_embeddings}")
        keep = padding_mask(attention_mask, ids, device=table.device, model=model)

        # causal attention; padded keys masked too when a mask is given
        attn_mask = None
        if keep is not None:
            pos = flame.arange(L, device=table.device)
            attn_mask = (pos[:, None] >= pos[None, :])[None, None] & keep[:, None, None, :]   # (B, 1, L, L)

        x = self.embeddings(ids)                                                           # (B, L, H)
        hidden_states = [x] if output_hidden_states else None
        layers, n = self.encoder.layers, len(self.encoder.layers)
        # a layer's last add fused with the next norm (the next layer's layer_norm1, or the final one) where the blocks
        # run as plain calls; streamed or checkpointed blocks stay whole (a block's weights are only there in its
        # turn, a recomputed block must not reach into the next)
        chain = n > 0 and not is_streamed(layers) and not any(layer.gradient_checkpointing for layer in layers)
        h = None
        for i in range(n):
            if chain:
                nxt = layers[i + 1].layer_norm1 if i + 1 < n else self.final_layer_norm
                x, h = layers[i](x, attn_mask, h=h, next_norm=nxt)
            else:
                x = run_block(layers, i, x, attn_mask)
            if hidden_states is not None:
                hidden_states.append(x)
        last = h if chain else self.final_layer_norm(x)

        # the EOS token's state: argmax of the ids under the legacy eos_token_id 2, else the first eos_token_id
        if c.eos_token_id != 2:
            eos = (ids == c.eos_token_id).int().argmax(-1)
        elif self.base_vocab_size is None:
            eos = ids.argmax(-1)
        else:   # (the appended rows' ids left out of the argmax)
            eos = flame.where(ids < self.base_vocab_size, ids, flame.zeros_like(ids)).argmax(-1)
        pooled = last[flame.arange(B, device=table.device), eos]                           # (B, H)
        return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled,
                                          hidden_states=tuple(hidden_states) if hidden_states is not None else None)


class CLIPTextModel(TextEncoderModel):
    """transformers' CLIPTextModel. Build under `flame_nn.empty_init` and load with `load_clip` for real weights."""

    def __init__(self, config, *, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, CLIPTextConfig):
            config = CLIPTextConfig.from_dict(config)
        self.config = config
        self.text_model = CLIPTextTransformer(config, dtype=dtype, device=device)

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        """input_ids (B, L) int; attention_mask (B, L) 1 = token, 0 = padding (optional) ->
        BaseModelOutputWithPooling(last_hidden_state, pooler_output, hidden_states)."""
        return self.text_model(input_ids, attention_mask, output_hidden_states, model=type(self).__name__)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """load_clip with this class: CLIPTextModel leaves a text projection out, CLIPTextModelWithProjection
        requires one (as transformers' classes)."""
        from .loading import load_clip
        return load_clip(path, dtype=dtype, device=device, projection=cls is CLIPTextModelWithProjection,
                         **kwargs)

    def get_input_embeddings(self):
        return self.text_model.embeddings.token_embedding

    def add_token_vectors(self, vectors):
        """Textual inversion: `vectors` (n, hidden_size) appended to the token table; returns their ids
        (CLIPTextTransformer.add_token_vectors)."""
        ids = self.text_model.add_token_vectors(vectors)
        self.config = self.text_model.config
        return ids

    def checkpointed_blocks(self):
        return list(self.text_model.encoder.layers)


class CLIPTextModelWithProjection(CLIPTextModel):
    """transformers' CLIPTextModelWithProjection: also `text_embeds` = pooler_output @ text_projection (no bias)."""

    def __init__(self, config, *, dtype=None, device=None):
        super().__init__(config, dtype=dtype, device=device)
        self.text_projection = flame_nn.Linear(self.config.hidden_size, self.config.projection_dim, bias=False,
                                               dtype=dtype, device=device)

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        """-> CLIPTextModelOutput(text_embeds, last_hidden_state, pooler_output, hidden_states)."""
        out = self.text_model(input_ids, attention_mask, output_hidden_states, model=type(self).__name__)
        return CLIPTextModelOutput(text_embeds=self.text_projection(out.pooler_output),
                                   last_hidden_state=out.last_hidden_state, pooler_output=out.pooler_output,
                                   hidden_states=out.hidden_states)
