"""GradScaler: dynamic loss scaling for float16 training (PyTorch's API and update rule).

    scaler = GradScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)          # optional: before clipping gradients
    scaler.step(opt)              # skipped when a gradient holds inf/nan
    scaler.update()               # back off on inf/nan, grow after `growth_interval` clean steps

Works with any optimizer that has `param_groups` (list of dicts with "params") and `step()`; an optimizer with a
`sync_grads()` method (amp.MasterWeightOptimizer) has it called first, so the fp32 master gradients are unscaled.
"""
import sys
import warnings

from .. import backend
from .. import dtypes as D

READY, UNSCALED, STEPPED = 0, 1, 2


def _nonfinite(a):
    xp = backend.xp_of(a)
    return xp.logical_not(xp.isfinite(a).all())


def _split_pooled(params):
    """(flat buffers wholly made of these parameters' current gradients, ids of the other parameters).

    Only when flame_core.grad_pool is in use: a buffer qualifies when every live parameter in it is in `params`
    and its .grad is the pool's view (so the buffer holds nothing stale, and its gaps are zeros)."""
    gp = sys.modules.get("flame_core.grad_pool")
    if gp is None or not gp.buffers():
        return [], {id(p) for p in params}
    mine = {id(p): p for p in params}
    flat, covered = [], set()
    for buf in gp.buffers():
        live = [s.ref() for s in buf.live_slots()]
        if not live or any(q is None or id(q) not in mine for q in live):
            continue
        base = buf.tensor.data_ptr()
        ok = True
        for q in live:
            off, _ = gp.slice_of(q)
            g = q.grad
            if g is None or g.data_ptr() != base + off * buf.tensor.element_size() or not g.is_contiguous():
                ok = False
                break
        if ok:
            flat.append(buf.tensor)
            covered.update(id(q) for q in live)
    return flat, set(mine) - covered


def _fresh_state():
    return {"stage": READY, "found_inf": None}


class GradScaler:
    def __init__(self, device="cuda", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        if not growth_factor > 1.0:
            raise ValueError(f"GradScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval <= 0:
            raise ValueError(f"GradScaler: growth_interval must be a positive int, got {growth_interval}")
        if not init_scale > 0:
            raise ValueError(f"GradScaler: init_scale must be > 0, got {init_scale}")
        self._device = str(device)
        if enabled and self._device.startswith("cuda") and not backend.cuda_available():
            warnings.warn("GradScaler is enabled, but CuPy sees no GPU; disabling it", stacklevel=2)
            enabled = False
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._per_optimizer = {}

    # ------------------------------------------------------------------ scaling the loss
    def scale(self, outputs):
        """outputs * scale. Half-precision outputs are promoted to float32 first (2**16 overflows float16)."""
        if not self._enabled:
            return outputs
        from ..tensor import Tensor
        if isinstance(outputs, Tensor):
            if outputs.dtype in (D.float16, D.bfloat16):
                outputs = outputs.to(D.float32)
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"GradScaler.scale: outputs must be a Tensor or a list/tuple of Tensors, "
                        f"got {type(outputs).__name__}")

    # ------------------------------------------------------------------ unscaling and the inf check
    def _state(self, optimizer):
        st = self._per_optimizer.get(id(optimizer))
        if st is None:
            st = self._per_optimizer[id(optimizer)] = _fresh_state()
        return st

    @staticmethod
    def _params_with_grad(optimizer):
        return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _unscale_grads(self, optimizer, inv_scale, allow_fp16):
        """Multiply every gradient by inv_scale in place; returns device flags (any non-finite), one per array
        touched. Gradients that fill a whole gradient-pool buffer are handled with one op on the flat buffer."""
        params = self._params_with_grad(optimizer)
        for p in params:
            if p.grad.dtype is D.float16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients: keep fp32 master weights "
                                 "(amp.MasterWeightOptimizer) or parameters in float32")
        flat, rest = _split_pooled(params)
        flags = []
        for buf in flat:
            a = buf._data
            a *= inv_scale
            flags.append(_nonfinite(a))
        for p in params:
            if id(p) not in rest:
                continue
            g = p.grad
            a = g._data
            if a.flags.c_contiguous and getattr(a.flags, "writeable", True):
                a *= inv_scale
            else:  # a broadcast (stride-0, read-only) gradient: give it its own storage
                g._data = a = a * inv_scale
            flags.append(_nonfinite(a))
        for p in params:
            p.grad._version[0] += 1
        return flags

    def unscale_(self, optimizer):
        """Divide the optimizer's gradients by the scale (in place) and record whether any is inf/nan."""
        if not self._enabled:
            return
        st = self._state(optimizer)
        if st["stage"] == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if st["stage"] == STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        sync = getattr(optimizer, "sync_grads", None)
        if sync is not None:
            sync()
        st["found_inf"] = self._unscale_grads(optimizer, 1.0 / self._scale, allow_fp16=False)
        st["stage"] = UNSCALED

    @staticmethod
    def _found_inf(st):
        """Resolve the per-gradient device flags to one bool (one host sync per array module) and keep it."""
        flags = st["found_inf"]
        if isinstance(flags, list):
            by_mod = {}
            for f in flags:
                by_mod.setdefault(backend.xp_of(f), []).append(f)
            st["found_inf"] = flags = any(bool(xp.stack(fs).any()) for xp, fs in by_mod.items())
        return flags

    def step(self, optimizer, *args, **kwargs):
        """unscale_ (if not done yet), then optimizer.step() unless a gradient is inf/nan. Returns step's value,
        or None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        st = self._state(optimizer)
        if st["stage"] == STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if st["stage"] == READY:
            self.unscale_(optimizer)
        found = self._found_inf(st)
        ret = None if found else optimizer.step(*args, **kwargs)
        st["stage"] = STEPPED
        return ret

    def update(self, new_scale=None):
        """Adjust the scale: x backoff_factor if any stepped optimizer saw inf/nan, x growth_factor after
        growth_interval clean steps in a row. `new_scale` (float or 1-element Tensor) sets it directly."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale.item() if hasattr(new_scale, "item") else new_scale)
        else:
            recorded = [st for st in self._per_optimizer.values() if st["found_inf"] is not None]
            if not recorded:
                raise RuntimeError("No inf checks were recorded prior to update(): call step() (or unscale_()) "
                                   "on at least one optimizer first.")
            self._update_scale(any([self._found_inf(st) for st in recorded]))
        self._per_optimizer = {}

    def _update_scale(self, found_inf):
        if found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
            grown = self._scale * self._growth_factor
            if grown != float("inf"):
                self._scale = grown
            self._growth_tracker = 0

    # ------------------------------------------------------------------ accessors and resume
    def get_scale(self):
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self):
        return self._growth_factor

    def set_growth_factor(self, new_factor):
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self):
        return self._backoff_factor

    def set_backoff_factor(self, new_factor):
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self):
        return self._growth_interval

    def set_growth_interval(self, new_interval):
        self._growth_interval = int(new_interval)

    def is_enabled(self):
        return self._enabled

    def state_dict(self):
        """PyTorch's keys; empty when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: missing keys {sorted(missing)}")
        s = state_dict["scale"]
        self._scale = float(s.item() if hasattr(s, "item") else s)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        t = state_dict["_growth_tracker"]
        self._growth_tracker = int(t.item() if hasattr(t, "item") else t)
