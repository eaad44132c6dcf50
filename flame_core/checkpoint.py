"""Activation (gradient) checkpointing: keep a region's inputs, drop its intermediates, recompute them in backward.

    y = flame_core.checkpoint(block, x)                      # the module is callable: checkpoint(fn, *args, ...)
    y = checkpoint_sequential(blocks, segments=4, input=x)   # all but the last segment checkpointed
    x = maybe_checkpoint(block, x, enabled=self.gradient_checkpointing, offload=self.checkpoint_offload)

How it works: the region runs once without recording (only its inputs are kept, optionally copied to pinned host
memory with `offload=True`). In backward the region runs again with grad recording on, under the RNG state
(`preserve_rng_state=True`: the default generators of cpu and of the inputs' GPUs) and the autocast state of the
first run, so dropout masks and bf16 casts are identical; then backward runs through that recomputed graph, which is
freed block by block. Parameters the region uses get their gradients even when no input requires grad (frozen
bases with LoRA), because the node is always recorded while grad mode is on.

Block stacks opt in through an attribute, the way PyTorch/diffusers models do:

    class Stack(Module):
        gradient_checkpointing = False   # user: model.gradient_checkpointing = True
        checkpoint_offload = False       # also move each checkpointed block input to pinned host memory
        def forward(self, x):
            for block in self.blocks:
                x = maybe_checkpoint(block, x, enabled=self.gradient_checkpointing,
                                     offload=self.checkpoint_offload)

Limitations (as PyTorch's reentrant checkpoint): the region's gradients flow through `backward()`; with
`autograd.grad(outputs, inputs)` the parameters inside a region are not reported and get `.grad` instead; no
double backward (create_graph=True) through a region; tensors nested inside lists/dicts of arguments are treated
as constants. `offload=True` applies to cuda tensors (cpu tensors already live in host memory); `offload` may also
be an object with `pack(tensors)` / `unpack(packed)` that keeps the inputs itself (flame_nn.offload's activation
offload: pinned buffers and a copy stream).
"""
import collections
import sys
import types

from . import backend
from . import random as _random
from .amp import autocast_mode as _amp
from .autograd.engine import run_backward
from .autograd.function import Function
from .autograd.grad_mode import enable_grad
from .autograd.grad_mode import state as _grad_state
from .errors import AutogradError, fmt_shape
from .tensor import Tensor, _wrap

_DUMMY = []  # one leaf that requires grad: makes the node record even when no input requires grad


def _dummy():
    if not _DUMMY:
        from .ops.creation import zeros
        _DUMMY.append(zeros((), requires_grad=True))
    return _DUMMY[0]


# ----------------------------------------------------------------------------- RNG fork
def _rng_devices(tensors):
    devs = ["cpu"]
    for t in tensors:
        d = str(t.device)
        if d not in devs:
            devs.append(d)
    return devs


def _get_rng(devices):
    return {d: _random.get_rng_state(d) for d in devices}


def _set_rng(states):
    for d, s in states.items():
        _random.set_rng_state(s, d)


# ----------------------------------------------------------------------------- pinned-host offload
_in_flight = collections.deque()  # (event, pinned buffer): kept alive until the copy that uses it has finished


def _reap():
    while _in_flight and _in_flight[0][0].done:
        _in_flight.popleft()


class _Offloaded:
    """A cuda array copied to pinned host memory, asynchronously, on the current stream.

    Every access to the pinned buffer is a copy on the device stream; only the pinned pool could hand the block to a
    host writer once we drop it, so the buffer is held until an event after its last copy has completed."""

    __slots__ = ("host", "shape", "dtype", "event", "device_id")

    def __init__(self, arr):
        cp = backend.cupy
        import cupyx
        _reap()
        arr = cp.ascontiguousarray(arr)
        self.shape, self.dtype, self.device_id = arr.shape, arr.dtype, arr.device.id
        self.host = cupyx.empty_pinned(arr.shape, dtype=arr.dtype)
        stream = cp.cuda.get_current_stream()
        if arr.nbytes:
            cp.cuda.runtime.memcpyAsync(self.host.ctypes.data, arr.data.ptr, arr.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self.event = stream.record()

    def restore(self):
        cp = backend.cupy
        _reap()
        with cp.cuda.Device(self.device_id):
            stream = cp.cuda.get_current_stream()
            stream.wait_event(self.event)
            out = cp.empty(self.shape, dtype=self.dtype)
            if out.nbytes:
                cp.cuda.runtime.memcpyAsync(out.data.ptr, self.host.ctypes.data, out.nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            self.event = stream.record()
        return out

    def __del__(self):
        host, event = getattr(self, "host", None), getattr(self, "event", None)
        if host is not None and event is not None and _in_flight is not None:
            _in_flight.append((event, host))


def _is_hooks(offload):
    """An `offload` object that keeps the region's tensor inputs itself: `pack(tensors) -> packed` in forward,
    `unpack(packed) -> tensors` in backward (PyTorch's saved-tensor hooks, for the region's inputs)."""
    return hasattr(offload, "pack") and hasattr(offload, "unpack")


# ----------------------------------------------------------------------------- the recompute Function
_recomputing = [0]   # how many checkpointed regions are recomputing now (nested ones count each)


def recomputing():
    """True while a checkpointed region's forward runs again in backward (its recompute): for ops whose forward must
    repeat what the first run did although state moved since (fp8 delayed scaling keeps the first run's scale)."""
    return _recomputing[0] > 0


# ----------------------------------------------------------------------------- selective checkpointing
SAVE_KINDS = ("attention",)  # ops whose outputs a region may keep for its recompute (`save=`)


class _Stash:
    """The outputs a checkpointed region's first run keeps for its recompute (selective checkpointing, as PyTorch's
    policies that save sdpa's outputs): an op of a kind in `kinds` puts its result here in the first run and, in the
    recompute, takes it back in the same order instead of computing it again (the same values: the op's inputs are
    recomputed identically), so only the region's cheap ops run twice.

    `source`: a region whose first run happens inside an enclosing region's recompute ran as a plain call (no
    region: grad mode was off) in that enclosing region's first run, so its ops' results sit in the enclosing
    region's stash: it takes them from there, in order. Each kept value carries the version counter of the tensor
    the op returned: a value overwritten in place since (an in-place op that runs only while no gradient is
    recorded, or the caller's, on the region's output) is refused instead of silently used."""

    __slots__ = ("kinds", "items", "pos", "replaying", "source")

    def __init__(self, kinds, source=None):
        self.kinds, self.items, self.pos, self.replaying = frozenset(kinds), [], 0, False
        self.source = source

    def put(self, kind, value, guard=None):
        self.items.append((kind, value, None if guard is None else (guard, guard[0])))

    def take(self, kind):
        if self.pos >= len(self.items):
            raise AutogradError(f"checkpoint: the recompute ran more {kind} ops than the region's first run "
                                f"({len(self.items)} kept); the function must be deterministic in its ops")
        got, value, guard = self.items[self.pos]
        if got != kind:
            raise AutogradError(f"checkpoint: the recompute's op {self.pos} is {kind}, the first run's was {got}")
        if guard is not None and guard[0][0] != guard[1]:
            raise AutogradError(f"checkpoint: the output of the region's {kind} op {self.pos} was modified in place "
                                f"after its first run; a region that keeps it (save=) cannot recompute from it")
        self.items[self.pos] = (got, None, None)  # freed as the recompute goes
        self.pos += 1
        return value


_stashes = []  # the stash (or None) of each region running now, innermost last


def stash(kind):
    """The stash an op of `kind` uses -- that of the innermost checkpointed region running now, when it keeps this
    kind or relays it from an enclosing recompute (`source`) -- or None. `stash.replaying`: the recompute (take the
    first run's result) rather than the first run (put, after taking it from `source` when that keeps the kind)."""
    if _stashes:
        s = _stashes[-1]
        if s is not None and (kind in s.kinds or (s.source is not None and kind in s.source.kinds)):
            return s
    return None


def save_kinds(save):
    kinds = (save,) if isinstance(save, str) else tuple(save or ())
    bad = [k for k in kinds if k not in SAVE_KINDS]
    if bad:
        raise ValueError(f"checkpoint: save={bad[0]!r} is not an op kind a region can keep (choose from "
                         f"{', '.join(SAVE_KINDS)})")
    return kinds


def _as_outputs(out):
    if isinstance(out, Tensor):
        return (out,), True
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, Tensor) for o in out):
        return tuple(out), False
    raise TypeError(f"checkpoint: the function must return a Tensor or a tuple of Tensors, got "
                    f"{type(out).__name__}")


class CheckpointFunction(Function):
    """The recompute node (PyTorch's reentrant `CheckpointFunction`). Subclass it to act around a region's
    backward (flame_nn's BlockStreamer brings a streamed block's weights back) and start it with `run`."""

    @classmethod
    def run(cls, function, args, kwargs, preserve_rng_state=True, offload=False, save=()):
        """`function(*args, **kwargs)` as one checkpointed region recorded as this class's node, whatever the grad
        mode (`checkpoint` is the call that falls back to a plain one without grad). `save`: op kinds whose outputs
        the first run keeps for the recompute (SAVE_KINDS)."""
        offload = offload if _is_hooks(offload) else bool(offload)
        return cls.apply(_dummy(), function, len(args), tuple(kwargs), bool(preserve_rng_state), offload,
                         save_kinds(save), *args, *kwargs.values())

    @staticmethod
    def forward(ctx, _dummy_leaf, run, n_args, kw_names, preserve_rng, offload, save, *flat):
        ctx.run, ctx.n_args, ctx.kw_names = run, n_args, kw_names
        parent = _stashes[-1] if _stashes else None
        source = parent if parent is not None and parent.replaying and parent.kinds else None
        running = _Stash(save, source) if (save or source is not None) else None
        ctx.stash = running if save else None
        tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, Tensor)]
        tensors = [flat[i] for i in tensor_pos]
        ctx.tensor_pos = tensor_pos
        ctx.requires = [t.requires_grad for t in tensors]
        ctx.constants = [None if isinstance(a, Tensor) else a for a in flat]
        ctx.rng = _get_rng(_rng_devices(tensors)) if preserve_rng else None
        ctx.amp = _amp.get_autocast_state()
        ctx.offloaded = ctx.packed = None
        if _is_hooks(offload):  # the caller keeps the inputs (flame_nn's activation offload)
            ctx.hooks, ctx.packed = offload, offload.pack(tensors)
        elif offload and any(backend.is_cuda_array(t._data) for t in tensors):
            ctx.offloaded = [(_Offloaded(t._data) if backend.is_cuda_array(t._data) else t.detach())
                             for t in tensors]
        else:
            ctx.save_for_backward(*tensors)

        _stashes.append(running)
        try:
            out, single = _as_outputs(run(*flat[:n_args], **dict(zip(kw_names, flat[n_args:]))))
        finally:
            _stashes.pop()
        ctx.single = single
        ids = {id(t) for t in tensors}
        # outputs that are pre-existing tensors (an input returned as is, a parameter) get an alias, so the
        # node never takes over their autograd identity
        outs = tuple(o._alias() if o is not None and (id(o) in ids or o._requires_grad or o._grad_fn is not None)
                     else o for o in out)
        return outs[0] if single else outs

    @staticmethod
    def backward(ctx, *grads):
        if _grad_state.enabled:
            raise AutogradError("checkpoint: backward with create_graph=True (double backward) through a "
                                "checkpointed region is not supported; call the function without checkpoint")
        if ctx.packed is not None:
            saved = ctx.hooks.unpack(ctx.packed)
            ctx.packed = None
        elif ctx.offloaded is not None:
            saved = [_wrap(o.restore()) if isinstance(o, _Offloaded) else o for o in ctx.offloaded]
        else:
            saved = ctx.saved_tensors
        inputs = []
        for t, req in zip(saved, ctx.requires):
            d = t.detach()
            inputs.append(d.requires_grad_(True) if req else d)
        flat = list(ctx.constants)
        for i, t in zip(ctx.tensor_pos, inputs):
            flat[i] = t
        n = ctx.n_args

        outer_rng = _get_rng(list(ctx.rng)) if ctx.rng is not None else None
        kept, ctx.stash = ctx.stash, None
        if kept is not None:
            kept.replaying, kept.source = True, None
        _recomputing[0] += 1
        _stashes.append(kept)
        try:
            if ctx.rng is not None:
                _set_rng(ctx.rng)
            with _amp.restore_autocast_state(ctx.amp), enable_grad():
                out, _ = _as_outputs(ctx.run(*flat[:n], **dict(zip(ctx.kw_names, flat[n:]))))
        finally:
            _stashes.pop()
            _recomputing[0] -= 1
            if outer_rng is not None:
                _set_rng(outer_rng)
        del kept

        roots, root_grads = [], []
        for k, (o, g) in enumerate(zip(out, grads)):
            if o is None or not o.requires_grad:
                continue
            if g is None:
                continue
            if g.shape != o.shape:
                raise AutogradError(f"checkpoint: recomputed output {k} has shape {fmt_shape(o.shape)}, the first "
                                    f"run gave {fmt_shape(g.shape)}; the function must be deterministic in shape")
            roots.append(o)
            root_grads.append(g if g.dtype == o.dtype else g.to(o.dtype))
        if roots:
            run_backward(roots, root_grads)
        in_grads = [None] * len(flat)
        for i, t, req in zip(ctx.tensor_pos, inputs, ctx.requires):
            if req:
                in_grads[i] = t.grad
        return (None, None, None, None, None, None, None, *in_grads)


def checkpoint(function, *args, use_reentrant=None, preserve_rng_state=True, offload=False, save=(), **kwargs):
    """Run `function(*args, **kwargs)` without keeping its intermediates; recompute them in backward.

    preserve_rng_state: replay the RNG streams (dropout) of the first run in the recompute (and leave the outer
    streams where they were). offload: keep the saved cuda inputs in pinned host memory until backward.
    save: op kinds whose outputs are kept from the first run instead of recomputed (selective checkpointing):
    "attention" keeps each scaled_dot_product_attention's output and logsumexp, so the recompute runs the region's
    matmuls and pointwise ops but not its attention (the output's memory per call against that kernel's time).
    `use_reentrant` is accepted for PyTorch compatibility; FLAME has one implementation.
    """
    if not _grad_state.enabled:
        return function(*args, **kwargs)
    return CheckpointFunction.run(function, args, kwargs, preserve_rng_state, offload, save)


def checkpoint_sequential(functions, segments, input, use_reentrant=None, preserve_rng_state=True,
                          offload=False):
    """Split `functions` (a sequence of callables, or a module whose children are) into `segments` chunks and
    checkpoint each chunk but the last, as torch.utils.checkpoint.checkpoint_sequential."""
    if hasattr(functions, "children") and not isinstance(functions, (list, tuple)):
        functions = list(functions.children())
    functions = list(functions)
    if not 1 <= segments <= max(len(functions), 1):
        raise ValueError(f"checkpoint_sequential: segments must be in [1, {len(functions)}], got {segments}")

    def run(start, end):
        def forward(x):
            for j in range(start, end + 1):
                x = functions[j](x)
            return x
        return forward

    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run(start, end), input, preserve_rng_state=preserve_rng_state, offload=offload)
    return run(end + 1, len(functions) - 1)(input)


def maybe_checkpoint(function, *args, enabled=None, offload=False, preserve_rng_state=True, save=None, **kwargs):
    """`checkpoint(function, ...)` when `enabled` (default: `function.gradient_checkpointing`) and grad mode is on,
    else a plain call. Block stacks call this for each block (see the module docstring). save (default:
    `function.checkpoint_save`, else nothing): the op kinds the region keeps (see `checkpoint`)."""
    if enabled is None:
        enabled = getattr(function, "gradient_checkpointing", False)
    if enabled and _grad_state.enabled:
        if save is None:
            save = getattr(function, "checkpoint_save", ())
        return checkpoint(function, *args, preserve_rng_state=preserve_rng_state, offload=offload, save=save,
                          **kwargs)
    return function(*args, **kwargs)


class _CallableModule(types.ModuleType):
    """`flame_core.checkpoint(fn, *args)` calls the function while `flame_core.checkpoint.checkpoint_sequential`
    etc. stay reachable: the module itself is callable."""

    def __call__(self, function, *args, **kwargs):
        return checkpoint(function, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["CheckpointFunction", "SAVE_KINDS", "checkpoint", "checkpoint_sequential", "maybe_checkpoint", "stash"]
