"""GraphedEncoder: a text encoder's forward replayed as a CUDA graph, one graph per input shape.

    encode = GraphedEncoder(load_clip(path, dtype=flame.bfloat16, device="cuda"))
    out = encode(ids)             # the first call for a shape runs eagerly, the second captures, later ones replay

Caching captions means thousands of calls with the same (B, 77) or (B, 512) ids; an eager forward issues every
layer's kernels from Python, tens of microseconds each, which at 77 tokens is longer than the GPU needs to run them.
A replay issues them all at once. The outputs are copied out of the graph's buffers, so they stay valid after the
next call. Falls back to the eager forward on cpu and for a model whose blocks are streamed (a streamed forward is
not capturable: its prefetch window changes from call to call).
"""
import flame_core as flame
from flame_core.cuda import graphed

from .inputs import padding_mask, token_ids


class GraphedEncoder:
    """Wraps a CLIPTextModel[WithProjection] or T5EncoderModel; called like it (input_ids, attention_mask=None,
    output_hidden_states=False). `warmup`: eager calls per shape before the capture; `max_graphs`: graphs kept
    (the oldest is dropped past it)."""

    def __init__(self, model, warmup=1, max_graphs=8):
        self.model, self.warmup, self.max_graphs = model, int(warmup), int(max_graphs)
        self._graphs = {}

    @property
    def enabled(self):
        return self.model.device.type == "cuda" and getattr(self.model, "streamer", None) is None

    def __call__(self, input_ids, attention_mask=None, output_hidden_states=False):
        m = self.model
        if not self.enabled:
            return m(input_ids, attention_mask=attention_mask, output_hidden_states=output_hidden_states)
        name = type(m).__name__
        vocab = m.config.vocab_size
        ids = token_ids(input_ids, vocab_size=vocab, device=m.device, model=name)  # host ids checked here
        keep = padding_mask(attention_mask, ids, device=m.device, model=name)
        key = (tuple(ids.shape), str(ids.dtype), keep is not None, bool(output_hidden_states))
        run = self._graphs.get(key)
        if run is None:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs))).reset()
            hidden = bool(output_hidden_states)
            if keep is None:
                run = graphed(lambda i: m(i, output_hidden_states=hidden), warmup=self.warmup)
            else:
                run = graphed(lambda i, k: m(i, attention_mask=k, output_hidden_states=hidden), warmup=self.warmup)
            self._graphs[key] = run
        with flame.no_grad():
            out = run(ids) if keep is None else run(ids, keep)
            return type(out)(**{k: (tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone())
                                for k, v in out.items()})

    def reset(self):
        """Drop every captured graph (and the memory it holds)."""
        for g in self._graphs.values():
            g.reset()
        self._graphs.clear()
