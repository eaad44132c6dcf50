"""A fused backward pass for any per-parameter optimizer: full fine-tuning of a model whose blocks stream.

    streamer = BlockStreamer.for_model(model, stream_trainable=True, device="cuda")  # trainable weights stream too
    opt = LayerwiseOptimizer(streamer, Adafactor(trained, lr=1e-5, relative_step=False, scale_parameter=False))
    loss.backward()      # each block is updated inside backward, as soon as its gradients are complete
    opt.step()           # the parameters outside the blocks (embedders, final layer)
    opt.zero_grad()

What kohya's `--fused_backward_pass` with `--blocks_to_swap` does for Flux and SDXL: the whole model's gradients never
exist at once. When block i's backward ends (the streamer's checkpoint node tells), its gradients are complete --
the block's parameters are its own and the blocks above it were run backward already -- so the wrapped optimizer
steps the block's parameters alone (`Optimizer.restricted`: each keeps its state, step count and stochastic-rounding
salt), the gradients are released (each block's trainable tensors have lazy gradient buffers of their own:
BlockStreamer(stream_trainable=True)), and the new weights go back to the block's pinned host copy
(BlockStreamer.write_back: a streamed block's on the copy stream, ordered before its next load; a resident block's
when the host copy is next read). The forward of the next step reads them.

The optimizer's state stays where the optimizer keeps it (on the device): Adafactor's factored moments (a row and a
column per matrix: a few MiB for Flux-dev) are what makes a 12B model trainable on a 24 GB card; AdamW8bit's 2 bytes
per parameter or AdamW's 8 fit smaller models. flame_nn.offload.LayerwiseAdamW keeps AdamW's moments in pinned host
memory instead. Optimizers whose parameters are coupled (`per_parameter` False: Prodigy, schedule-free AdamW, L-BFGS)
are refused.

max_grad_norm: the whole model's gradient norm is not known before the first block is updated, so a block's gradients
are clipped by their own norm (kohya clips each tensor by its own); `step()` does not clip the rest -- clip those
yourself before it, as usual. max_grad_value: each block's gradients clamped to [-v, v] first (an elementwise clip is
the same block by block as over the whole model). Every block's gradient norm is computed anyway: `grads_finite()`
reads whether all were finite since the last call (a device flag: no synchronisation).
`paused()`: blocks' gradients are dropped without an update (auto-fit's measured steps: their norm is still taken,
so the step's peak holds its temporaries).
Rules: gradient accumulation across backward passes is not possible (a block is updated by every backward), and a
streamer with a layer-wise optimizer cannot be captured in a CUDA graph.
"""
import contextlib

import flame_core as flame
from flame_core.autograd import enable_grad, no_grad

from ..optim.multi_tensor import keep_tables
from ..utils import zero_grads
from ..utils.clip_grad import _total_norm, clip_grad_value_, clip_grads_with_norm_
from ..utils.grads import grad_arrays
from .host import OffloadError


class LayerwiseOptimizer:
    """Wraps `optimizer` (over the streamer's blocks' trainable tensors and any others) so that the blocks' tensors are
    updated inside backward, block by block; see the module docstring. The optimizer API (param_groups, state,
    step, zero_grad, state_dict, load_state_dict) is the wrapped optimizer's: a learning-rate scheduler and
    checkpoints work on this object as on the optimizer."""

    def __init__(self, streamer, optimizer, max_grad_norm=0.0, max_grad_value=None):
        if not streamer.stream_trainable:
            raise OffloadError("LayerwiseOptimizer needs a BlockStreamer built with stream_trainable=True")
        if streamer._layerwise is not None:
            raise OffloadError("this BlockStreamer already has a layer-wise optimizer")
        if not getattr(optimizer, "per_parameter", False):
            raise OffloadError(f"{type(optimizer).__name__} couples its parameters (a step over one block's would not "
                               f"be that block's part of a whole step); a layer-wise update takes a per-parameter "
                               f"optimizer: Adafactor, AdamW8bit, AdamW, Lion, ...")
        if not max_grad_norm >= 0:
            raise ValueError(f"LayerwiseOptimizer: max_grad_norm must be >= 0, got {max_grad_norm}")
        if max_grad_value is not None and not float(max_grad_value) > 0:
            raise ValueError(f"LayerwiseOptimizer: max_grad_value must be None or > 0, got {max_grad_value}")
        self.optimizer, self.max_grad_norm = optimizer, float(max_grad_norm)
        self.max_grad_value = None if max_grad_value is None else float(max_grad_value)
        groups = optimizer.param_groups
        where = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        self._blocks, in_blocks = [], set()
        for name, hb in zip(streamer.names, streamer._host):
            tensors = [e.tensor for e in hb.trainable]
            missing = [e.name for e in hb.trainable if id(e.tensor) not in where]
            if missing:
                raise OffloadError(f"block {name}: trainable {missing[:3]} not among the optimizer's parameters")
            mapped = [e.name for e in hb.trainable if e.offset >= hb.pinned_bytes]
            if mapped:
                raise OffloadError(f"block {name}: trainable {mapped[:3]} stream from a mapped file; trainable "
                                   f"weights need a pinned host copy (build the streamer without sources=)")
            ids = {id(t) for t in tensors}
            in_blocks |= ids
            self._blocks.append([[p for p in g["params"] if id(p) in ids] for g in groups] if tensors else None)
        if not in_blocks:
            raise OffloadError("LayerwiseOptimizer: the streamer's blocks have no trainable tensors "
                               "(requires_grad_(True) them before building the streamer)")
        self._rest = [[p for p in g["params"] if id(p) not in in_blocks] for g in groups]
        self._streamer = streamer
        # one kernel table per block (two: parameters of two step counts or dtypes), each built once for the run
        keep_tables(optimizer, 2 * len(self._blocks) + 8)
        self._updating = True
        self._finite = None     # device bool: every block gradient finite since grads_finite() last read it
        self.block_steps = 0    # blocks updated so far (tests, progress)
        streamer._layerwise = self

    # ------------------------------------------------------------------ the optimizer's API
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def running_keys(self):
        return getattr(self.optimizer, "running_keys", ())

    def step(self, closure=None):
        """Update the parameters outside the streamer's blocks (the blocks were updated during backward)."""
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        if any(self._rest):
            with self.optimizer.restricted(self._rest):
                self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    # ------------------------------------------------------------------ layer-wise
    @contextlib.contextmanager
    def paused(self):
        """Within the block, backward drops the blocks' gradients without updating them (a measured step)."""
        was, self._updating = self._updating, False
        try:
            yield self
        finally:
            self._updating = was

    def grads_finite(self):
        """A device bool: whether every block gradient since the last call was finite (then forgotten); None when no
        block was updated since."""
        got, self._finite = self._finite, None
        return got

    def _before_backward(self, i):
        pass

    def _after_backward(self, i):
        subsets = self._blocks[i]
        if subsets is None:
            return
        params = [p for sub in subsets for p in sub]
        with_grad = [p for p in params if p._grad is not None]
        if with_grad:   # (paused too: a measured step holds the norm's temporaries as an updating one does)
            norm = flame.as_tensor(_total_norm(grad_arrays(with_grad), 2.0, False))  # one reduction per buffer
            clip_norm = norm
            if self.max_grad_value is not None:   # (`norm`, of the gradients as they came, says whether finite)
                clip_grad_value_(with_grad, self.max_grad_value)
                if self.max_grad_norm > 0:
                    clip_norm = flame.as_tensor(_total_norm(grad_arrays(with_grad), 2.0, False))
            if self.max_grad_norm > 0:
                clip_grads_with_norm_(with_grad, self.max_grad_norm, clip_norm)
        if with_grad and self._updating:
            ok = flame.isfinite(norm)
            self._finite = ok if self._finite is None else self._finite & ok
            with no_grad(), self.optimizer.restricted(subsets):
                self.optimizer.step()
            self.block_steps += 1
        zero_grads(params, set_to_none=True)   # the block's gradient buffers released
        if not with_grad or not self._updating:
            return
        # the new weights back to the block's host copy (a streamed block's now: its next load follows them)
        self._streamer.write_back(i, self._streamer._host[i].trainable)
