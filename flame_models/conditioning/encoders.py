"""What the pipelines' prompt encoders share: a bundle of text encoders that is freed as one (device pool, pinned
host buffers, CUDA graphs), and CLIP's conditioning -- a hidden state (SDXL and SD3: the penultimate layer, before
the final LayerNorm) and a pooled vector (`text_embeds` when the encoder has a text projection, else
`pooler_output`) -- with, as an option, long captions in 77-token chunks.

Long captions (max_token_length = 75 n, n > 1) follow kohya sd-scripts' `--max_token_length` (library/
strategy_base.py / strategy_sdxl.py): the caption is tokenised to 75 n + 2 ids (BOS, up to 75 n content tokens, EOS,
padding) and cut into n chunks of 77 -- BOS, the next 75 ids, then the last id (EOS or padding); when the pad token
is not EOS (CLIP-G), a chunk whose content runs to its end gets EOS last, and a chunk that starts with padding gets
EOS after BOS -- every chunk is encoded, and the states are joined back into 75 n + 2: the first chunk's BOS state,
positions 1..75 of every chunk, the last chunk's last state. The pooled vector is the first chunk's. Every caption
gets all n chunks (empty ones are BOS, EOS, padding), so a batch has one shape.
"""
import gc

import numpy as np

import flame_core as flame
from flame_core import memory

from ..text_encoders import GraphedEncoder

CHUNK = 75  # content tokens per 77-token CLIP window


class EncoderBundle:
    """Base of a pipeline's text encoders: subclasses set the attributes named in `encoder_attrs` (encoders, None
    allowed) and `tokenizer_attrs`, then call `_start()`. `free()` (or leaving a `with` block) releases them all."""

    encoder_attrs = ()
    tokenizer_attrs = ()
    _runs = None

    def _start(self):
        # on cuda each batch shape is replayed as a CUDA graph (eager calls are bound by the host's per-op cost);
        # eager on the cpu and for a streamed encoder
        self._runs = {a: GraphedEncoder(getattr(self, a)) for a in self.encoder_attrs if getattr(self, a) is not None}

    def _run(self, attr):
        return self._runs[attr]

    @property
    def device(self):
        self._check_alive()
        return next(getattr(self, a) for a in self.encoder_attrs if getattr(self, a) is not None).device

    def _encode_batched(self, prompts, batch_size, encode_batch):
        """{"prompt_embeds", "pooled_prompt_embeds"} of `prompts` (a str or a list of str): `encode_batch(prompts)`
        -> (embeds, pooled) run `batch_size` prompts at a time (default: all at once) without recording gradients,
        the batches joined."""
        self._check_alive()
        prompts = prompt_list(prompts)
        step = len(prompts) if batch_size is None else max(1, int(batch_size))
        embeds, pooled = [], []
        with flame.no_grad():
            for lo in range(0, len(prompts), step):
                e, p = encode_batch(prompts[lo:lo + step])
                embeds.append(e)
                pooled.append(p)
        cat = (lambda xs: xs[0] if len(xs) == 1 else flame.cat(xs, dim=0))
        return {"prompt_embeds": cat(embeds), "pooled_prompt_embeds": cat(pooled)}

    def _check_alive(self):
        if self._runs is None:
            raise RuntimeError(f"these {type(self).__name__} were freed; load them again")

    def free(self):
        """Drop every encoder and return its memory (device pool and pinned host buffers) now."""
        if self._runs is None:
            return
        device = self.device
        streamers = [getattr(getattr(self, a), "streamer", None) for a in self.encoder_attrs]
        for s in streamers:
            if s is not None:
                s.synchronize()
        for run in self._runs.values():
            run.reset()
        for a in self.encoder_attrs + self.tokenizer_attrs:
            setattr(self, a, None)
        self._runs = None
        del streamers
        gc.collect()  # a streamer and its stacks refer to each other
        memory.empty_cache(device)
        memory.empty_pinned_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


def prompt_list(prompts, what="prompts"):
    """A str or a non-empty list of str, as a list. TypeError naming the bad entry."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(f"{what} must be a str or a non-empty list of str, got {prompts!r:.80}")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{what}[{bad[0]}] is a {type(prompts[bad[0]]).__name__}, not a str")
    return list(prompts)


def prompt_rows(cond, rows, device, dtype):
    """(prompt_embeds (B, L, D), pooled_prompt_embeds (B, P)) of a pipeline's conditioning dict `cond` (Tensors or
    NumPy arrays) on `device` in `dtype`, row i of the batch being prompt rows[i] of `cond`."""
    out = []
    for key in ("prompt_embeds", "pooled_prompt_embeds"):
        t = cond[key]
        if isinstance(t, flame.Tensor):
            t = t if list(rows) == list(range(t.shape[0])) else flame.stack([t[i] for i in rows], dim=0)
            out.append(t.to(device).to(dtype))
        else:
            out.append(flame.tensor(np.ascontiguousarray(np.asarray(t)[list(rows)], dtype=np.float32),
                                    device=device).to(dtype))
    return tuple(out)


def check_max_token_length(max_token_length):
    """None (CLIP's 77 tokens, longer captions truncated) or a multiple of 75 (kohya's 150, 225, ...)."""
    if max_token_length is None:
        return None
    if isinstance(max_token_length, bool) or not isinstance(max_token_length, int) or max_token_length < CHUNK \
            or max_token_length % CHUNK:
        raise ValueError(f"max_token_length must be None or a multiple of {CHUNK} (75, 150, 225, ...), got "
                         f"{max_token_length!r}")
    return max_token_length


def clip_ids(tokenizer, prompts, max_token_length=None):
    """Token ids (B * n, 77) int64 of `prompts` for one CLIP, n = max_token_length / 75 chunks per caption (1:
    diffusers' padding and truncation to 77)."""
    if max_token_length is None or max_token_length == CHUNK:
        return tokenizer(prompts, padding="max_length", truncation=True, return_attention_mask=False).input_ids
    L = tokenizer.model_max_length
    if L != CHUNK + 2:
        raise ValueError(f"chunked captions need a 77-token CLIP tokenizer, {tokenizer.source} has {L}")
    ids = tokenizer(prompts, max_length=max_token_length + 2, padding="max_length", truncation=True,
                    return_attention_mask=False).input_ids
    return chunk_rows(tokenizer, ids, max_token_length)


def chunk_rows(tokenizer, rows, max_token_length):
    """Rows of max_token_length + 2 ids (B, 75 n + 2) cut into kohya's n chunks of 77 (B * n, 77) (the module
    docstring); tokenizer None: rows of per-token values (prompt weights) cut at the same positions, unchanged."""
    eos = None if tokenizer is None else tokenizer.eos_token_id
    pad = None if tokenizer is None else tokenizer.pad_token_id
    chunks = []
    for row in rows:
        for i in range(1, max_token_length + 1, CHUNK):
            chunk = np.concatenate([row[:1], row[i:i + CHUNK], row[-1:]])
            if tokenizer is not None and pad != eos:
                if chunk[-2] != eos and chunk[-2] != pad:
                    chunk[-1] = eos
                if chunk[1] == pad:
                    chunk[1] = eos
            chunks.append(chunk)
    return np.stack(chunks)


def clip_states(run, model, ids, batch, *, hidden_layer=-2):
    """(hidden (B, L, C), pooled (B, P)) of a CLIP on `ids` from clip_ids (B * n rows): hidden_states[hidden_layer]
    (the penultimate layer by default: no final LayerNorm), the n chunks joined as kohya does; pooled = text_embeds
    when the model has a text projection, else pooler_output, of each caption's first chunk. In the model's dtype."""
    out = run(ids, output_hidden_states=True)
    hidden = out.hidden_states[hidden_layer].to(model.dtype)
    pooled = (out.text_embeds if getattr(out, "text_embeds", None) is not None else out.pooler_output).to(model.dtype)
    n = ids.shape[0] // batch
    if n == 1:
        return hidden, pooled
    L, C = hidden.shape[1], hidden.shape[2]
    h = hidden.reshape(batch, n * L, C)
    parts = [h[:, :1]] + [h[:, k * L + 1:k * L + L - 1] for k in range(n)] + [h[:, n * L - 1:]]
    return flame.cat(parts, dim=1), pooled.reshape(batch, n, pooled.shape[-1])[:, 0]
