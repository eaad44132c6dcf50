"""LoRA files merged into a model's weights as its checkpoint is read (ai-toolkit's `model.lora_path` and
`assistant_lora_path`): W' = W + Σ_i w_i (AdapterPart.merged_weight(W) − W) -- each file's change against the base
weight, times its weight, summed in float32 and rounded once to W's dtype, as pipeline.loras.apply_loras merges at
sampling time -- computed on `device` (a GPU merges Flux in seconds) and handed back where the load keeps the weight.

Merging as the weights are read (checkpoint_io.merge_on_read) is what lets it meet every placement: a weight
merged before fp8 storage quantises it (a scaled-fp8 file's weight read dequantised first), before a streamer packs
it into host memory, with no second copy of the model anywhere. `merge_into` merges into a model already built (a
random one, or one handed to the trainer), whose weights are not fp8.

    merger = MergedLoRAs([(weight, modules), ...], device, label="model.lora_path ...")
    with checkpoint_io.merge_on_read(merger):
        model = load(...)

`modules` is a file's canonical adapters ({module: [AdapterPart]}: flame_nn.adapters.formats.load, checked against
the model by pipeline.loras.check_lora_part)."""
import numpy as np

import flame_core as flame
from flame_core import backend

from ..conditioning.files import ModelFilesError


class MergedLoRAs:
    """The adapters of LoRA files, by module, to merge into a model's weights: `keys(model)` the weights they change,
    `merger(key, w)` the merged weight (same dtype and device as w). error: the exception for problems, naming
    `label` (the files, or the settings that gave them)."""

    def __init__(self, files, device=None, *, label="--lora", error=ModelFilesError):
        self.by_module = {}
        for weight, modules in files:
            for module, parts in modules.items():
                self.by_module.setdefault(module, []).extend((float(weight), p) for p in parts)
        self.device = None if device is None else flame.device(device)
        self.label, self.error = label, error
        self._finite = []   # [(key, 0-d bool Tensor)]: each merged weight's finiteness, read back once by check()

    def describe(self):
        return self.label

    def keys(self, model=None):
        """The model keys ("<module>.weight") of the weights the files change."""
        return frozenset(f"{m}.weight" for m in self.by_module)

    def __call__(self, key, w):
        """`w` (a weight Tensor, the model's `key`) with the files' adapters merged in: computed in float32 on the
        merger's device, rounded once to w's dtype, returned on w's device. Whether the result is finite is noted on
        the device (no host sync per weight); check() -- merge_on_read calls it when the load returns, merge_into
        at its end -- reads every note at once."""
        entries = self.by_module[key[:-len(".weight")]]
        dev = self.device if self.device is not None else w.device
        base = w.detach().to(dev).to(flame.float32).array
        xp = backend.xp_of(base)
        dora = any(p.kind == "dora" for _, p in entries)
        # the float32 copy of another dtype or device is ours to add into; a DoRA's change is taken against W itself
        out = base.copy() if dora or (w.dtype == flame.float32 and w.device == dev) else base
        for weight, p in entries:
            lo, hi = p.rows if p.rows is not None else (0, base.shape[0])
            if p.kind == "dora":
                rows = base[lo:hi]
                out[lo:hi] += weight * (p.merged_weight(rows, xp, np.float32) - rows)
            else:   # LoRA / LoKr / LoHa: W + ΔW, so the change is ΔW itself (one pass fewer than W' − W)
                d = p.delta_weight(xp, np.float32)
                if weight != 1.0:
                    d *= weight
                out[lo:hi] += d.reshape(hi - lo, *base.shape[1:])
        merged = flame.as_tensor(out).to(w.dtype)
        self._finite.append((key, str(w.dtype), flame.isfinite(merged).all()))
        return merged.to(w.device)

    def check(self):
        """The error naming the first merged weight that is not finite (an overflow of its dtype, or a file's
        values), reading every weight's note in one host transfer; the notes are cleared."""
        notes, self._finite = self._finite, []
        if not notes:
            return
        ok = flame.stack([flag.to(notes[0][2].device) for _, _, flag in notes]).cpu().numpy()
        for (key, dtype, _), good in zip(notes, ok):
            if not good:
                raise self.error(f"{self.label}: merging it into {key} gives values that are not finite (an "
                                 f"overflow of {dtype}, or a file's values)")

    def merge_into(self, model):
        """Merge into `model`'s weights in place (a model already built: random, or handed over); a weight stored in
        fp8 cannot take it: the error names it."""
        with flame.no_grad():
            for key in sorted(self.keys()):
                p = model.get_parameter(key)
                if p.dtype is flame.float8_e4m3fn:
                    raise self.error(f"{self.label}: {key} is stored in fp8, which cannot take a merged change; "
                                     f"merge into the weights before fp8 storage")
                p.copy_(self(key, p))
        self.check()
        return model
