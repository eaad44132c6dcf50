"""Exponential moving average of the trained (adapter) parameters: shadow = d·shadow + (1 − d)·p after each step.

`ema.swapped()` puts the averaged values into the parameters for sampling or saving, and back afterwards (in place:
a CUDA graph that captured the parameters' storage keeps seeing them). The shadows are float32 (as the adapters), on
the parameters' device.
"""
from contextlib import contextmanager

import flame_core as flame
from flame_core.autograd import no_grad


class EMA:
    def __init__(self, params, decay=0.99):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.params = list(params)
        self.decay = float(decay)
        with no_grad():
            self.shadow = [p.detach().to(flame.float32).clone() for p in self.params]
        self.num_updates = 0

    def update(self):
        with no_grad():
            for s, p in zip(self.shadow, self.params):
                s.lerp_(p.detach().to(s.dtype), 1.0 - self.decay)
        self.num_updates += 1

    @contextmanager
    def swapped(self):
        """Parameters hold the EMA values inside the block (and their own values again after it)."""
        with no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield self
        finally:
            with no_grad():
                for p, a in zip(self.params, saved):
                    p.copy_(a)

    def state_dict(self):
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": list(self.shadow)}

    def load_state_dict(self, state):
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state['shadow'])} tensors, the run trains {len(self.shadow)}")
        self.decay, self.num_updates = float(state["decay"]), int(state["num_updates"])
        with no_grad():
            for s, t in zip(self.shadow, state["shadow"]):
                if tuple(s.shape) != tuple(t.shape):
                    raise ValueError(f"EMA shadow shape {tuple(t.shape)} != parameter shape {tuple(s.shape)}")
                s.copy_(t)
