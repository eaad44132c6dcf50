"""Non-finite training stops the run: a NaN or infinite loss or gradient is caught, the run ends naming the step and
its samples' files, and nothing from that step on is saved (no checkpoint, no LoRA: the newest checkpoint stays the
last good one).

Without a host synchronisation per step: the checks are array operations queued with the step's own work -- the
loss's inside the region a CUDA graph captures (`watch_loss`: `flag |= ~isfinite(loss)`, replayed with the graph),
the gradients' on the flat gradient buffers after accumulation (`after_backward`: one isfinite reduction per buffer;
with several ranks after the all-reduce, so every rank sees the same) -- and they keep, on the device, the first step
that went wrong and what did. The host reads that once, in `check()`, which the trainer calls where it reads results
anyway: before a loss-log row, a preview, a checkpoint and the final LoRA.

    guard = FiniteGuard(params, device)
    loss = forward_backward(...); guard.watch_loss(loss)       # inside the captured step
    guard.after_backward(step, batch_indices, captions)       # after the micro-steps, before the optimizer
    guard.check(dataset)                                      # NonFiniteError naming the step and its files
"""
import numpy as np

import flame_core as flame
from flame_core import grad_pool
from flame_core.errors import FlameError

LOSS, GRADIENTS = 1, 2


class NonFiniteError(FlameError, RuntimeError):
    """The loss or the gradients became NaN or infinite; training stopped before saving anything from that step."""


class FiniteGuard:
    def __init__(self, params, device, also=None):
        """also: None, or a callable returning a device bool (or None) of gradients `params` no longer hold: whether
        the ones seen since its last call were finite (a layer-wise optimizer's blocks, updated inside backward)."""
        self.params, self.device, self.also = list(params), device, also
        self.loss_bad = flame.zeros((), dtype=flame.bool, device=device)       # set inside the captured step
        self.first_step = flame.full((), -1, dtype=flame.int64, device=device)  # the first bad step, -1: none
        self.first_what = flame.zeros((), dtype=flame.int64, device=device)     # LOSS | GRADIENTS of that step
        self.batches = {}  # step -> (dataset indices, captions) of its micro-batches since the last check

    def watch_loss(self, loss):
        """Inside the captured region: remember whether `loss` (a device scalar) is finite; no host sync."""
        self.loss_bad.copy_(self.loss_bad | ~flame.isfinite(loss.detach()))

    def _gradients_finite(self):
        """A device bool: every gradient of `params` finite (one reduction per flat gradient buffer)."""
        tensors, seen = [], set()
        for p in self.params:
            if grad_pool.is_registered(p):
                buf = grad_pool.buffer_of(p)
                if id(buf) not in seen and buf.resident:   # (a lazy buffer without storage holds no gradient)
                    seen.add(id(buf))
                    tensors.append(buf.tensor)
            elif p.grad is not None:
                tensors.append(p.grad)
        ok = flame.ones((), dtype=flame.bool, device=self.device)
        for t in tensors:
            ok = ok & flame.isfinite(t.detach()).all()
        seen = self.also() if self.also is not None else None
        return ok if seen is None else ok & seen

    def after_backward(self, step, indices=(), captions=()):
        """After step `step`'s micro-batches (gradients accumulated, all-reduced), before the optimizer: fold the
        loss flag and the gradients' check into the first bad step. `indices` / `captions`: the step's samples,
        named if the step turns out bad."""
        what = self.loss_bad.long() * LOSS + (~self._gradients_finite()).long() * GRADIENTS
        new = (self.first_step < 0) & (what > 0)
        self.first_step.copy_(flame.where(new, flame.full((), step, dtype=flame.int64, device=self.device),
                                          self.first_step))
        self.first_what.copy_(flame.where(new, what, self.first_what))
        self.loss_bad.zero_()
        self.batches[step] = ([int(i) for i in indices], [str(c) for c in captions])

    def check(self, dataset=None):
        """Read the flags (one host sync): NonFiniteError naming the first bad step, what went wrong and its
        samples' files (where `dataset` can say); else forget the steps seen so far."""
        step, what = (int(v) for v in flame.stack([self.first_step, self.first_what]).numpy())
        if step < 0:
            self.batches.clear()
            return
        indices, captions = self.batches.get(step, ([], []))
        files = sample_files(dataset, indices)
        parts = [n for bit, n in ((LOSS, "the loss"), (GRADIENTS, "the gradients")) if what & bit]
        samples = (f"; the step's samples: {', '.join(files)}" if files
                   else f"; the step's samples: dataset items {indices}" if indices else "")
        if captions:
            shown = [c if len(c) <= 60 else c[:57] + "..." for c in dict.fromkeys(captions)]
            samples += f"; captions: {shown}"
        raise NonFiniteError(
            f"step {step}: {' and '.join(parts)} became NaN or infinite{samples}. Training stopped; nothing from "
            f"step {step} on was saved (checkpoints and LoRAs are of earlier steps only). Check those files (a damaged "
            f"cache entry is encoded again on the next run), or lower train.lr")


    def check_parameters(self, step):
        """Before a save: NonFiniteError when a trained parameter holds NaN or inf (e.g. an optimizer update that
        overflowed from finite gradients). One host sync."""
        if not self.params:
            return
        by_device = {}   # (a layer-wise fine-tune's streamed weights are read from host memory: cpu tensors)
        for p in self.params:
            by_device.setdefault(str(p.device), []).append(~flame.isfinite(p.detach()).all())
        bad = np.concatenate([flame.stack(flags).numpy() for flags in by_device.values()])
        if bad.any():
            raise NonFiniteError(f"after step {step}: {int(bad.sum())} of {len(self.params)} trained parameter "
                                 f"tensors hold NaN or infinite values; nothing was saved (checkpoints and LoRAs "
                                 f"are of earlier steps only). Lower train.lr or set train.max_grad_norm")


def sample_files(dataset, indices):
    """The files of dataset items `indices` where the dataset knows them (image folders, sample folders), else []."""
    out = []
    for i in indices:
        f = _file_of(dataset, i)
        if f is None:
            return []
        out.append(f)
    return list(dict.fromkeys(out))


def _file_of(ds, i):
    if ds is None:
        return None
    if hasattr(ds, "latent_spec"):          # image folders
        return ds.latent_spec(i).path
    if hasattr(ds, "files"):                # a folder of sample files
        return ds.files[i]
    for part in getattr(ds, "parts", None) or []:  # ConcatDataset: the parts one after the other
        if i < len(part):
            return _file_of(part, i)
        i -= len(part)
    return None
