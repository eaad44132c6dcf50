"""BlockStreamer: run a stack of blocks whose weights live in pinned host memory, through a ring of K GPU slots.

    streamer = BlockStreamer([model.double_blocks, model.single_blocks], resident=range(8), slots=2, device="cuda")
    out = model(...)          # the model's forward calls run_block(stack, i, ...) for each block
    streamer.auto_fit("12GiB", step_fn)   # or let the budget choose which blocks stay resident

Blocks are numbered across the stacks (double 0..18 then single 19..56 for Flux). A resident block's weights sit on
the GPU in one buffer of their own; a streamed block's weights sit in a pinned host buffer and are copied into one of
K slot buffers (allocated once, reused forever) before the block runs. Trainable parameters (LoRA adapters live
outside the blocks anyway) stay on the GPU with their gradients, unless `stream_trainable` (full fine-tuning: a
layer-wise optimizer updates each block inside backward and writes it back to its host copy).

The schedule. Before block i runs, forward or backward, the streamer takes the window of the next K streamed blocks
in the order they will run (forward: i, i+1, ...; backward: i, i-1, ...; in inference the window wraps around to
block 0 for the next call) and makes sure each is in a slot or on its way:
  1. one event is recorded on the compute stream (it follows all work enqueued so far, i.e. every earlier use of
     every slot) and the copy stream waits on it;
  2. each missing block goes to its home slot -- streamed block number p (in run order) lives in slot p mod K --
     or, when a block of the window sits there (only a wrapped inference window can cause that), to the least
     recently used slot outside the window: the slot's previous block's tensors become placeholders, one
     host->device copy of the block's pinned buffer is enqueued on the copy stream, an event is recorded after it,
     and the block's tensors become views of the slot;
  3. the compute stream waits on the event of block i's slot (the schedule's only wait on the compute stream).
So block i+1 (forward) or i-1 (backward) is copied while block i computes; no device-wide synchronisation happens.
A window is K consecutive streamed blocks, so in training every block of it has its home slot to itself: the
placement is a fixed function of the block, and a training step ends (backward's last window: streamed blocks
K-1..0) in the state the next one starts from -- the first K streamed blocks in their home slots.

Training: a streamed block always runs under gradient checkpointing (whatever `gradient_checkpointing` says): its
backward recomputes it, so it needs its weights once more, in reverse order, and no saved tensor outlives the slot
it points into. The checkpoint node tells the streamer when block i's backward starts (load i, prefetch i-1) and
ends (layer-wise updates). Resident blocks follow their own `gradient_checkpointing` attribute, except under
`offload_activations`: then every block is checkpointed and the inputs carried from block to block wait in pinned host
memory for the backward, copied out and back on a copy stream of their own (flame_nn.offload.activations).

CUDA graphs: a streamed training step (forward + backward) can be captured and replayed as one graph
(flame_core.cuda.graphed; the trainer does it with `cuda_graph` on). The copies from pinned memory and the events
between the two streams are captured like kernels: inside the capture, the first copy's `copy_waits` on an event
recorded on the capturing stream forks the copy stream into the capture, and every copy is joined back when the
compute stream waits on its slot's event before the block runs; `join()` at the end of the captured region makes
the compute stream wait on the copy stream's last work whatever the schedule did. What Python decides -- which
block goes to which slot, the tensors' views -- happens once, at capture, and is baked into the graph; replays are
right only if every step starts from the state the capture started from. Home slots make the schedule a fixed
function of the block, so a step ends where it started (`join()` checks it inside a capture and raises otherwise);
`prime()` restores that state (eagerly, ordered before what follows) after anything else used the streamer --
sampling, an evaluation forward, set_resident -- and must run before each replay in that case (the trainer calls
it before every step). The streamer draws no random numbers and forgets its events at each capture boundary (an
event recorded outside a capture cannot be waited on inside it, nor a captured one outside). Not capturable:
inference forwards (their window wraps to the next call: not cyclic) and layer-wise updates (host round trips).
"""
import bisect
import contextlib
import gc
import itertools

from flame_core import memory as _memory
from flame_core.autograd.grad_mode import state as _grad_state
from flame_core.checkpoint import CheckpointFunction, maybe_checkpoint
from flame_core.device import default_device
from flame_core.device import device as _parse_device
from flame_core.io import convert

from ..module import Module
from .activations import ActivationOffload
from .engine import copy_engine, device_bytes
from .host import HostBlock, OffloadError

_ATTR = "_flame_streamer"


def run_block(stack, i, *args, **kwargs):
    """Run block `i` of `stack` (a ModuleList): through its BlockStreamer when one is attached, else as
    `maybe_checkpoint(block, ...)` (checkpointed when the block's `gradient_checkpointing` is set)."""
    hook = stack.__dict__.get(_ATTR)
    if hook is None:
        block = stack[i]
        return maybe_checkpoint(block, *args, offload=getattr(block, "checkpoint_offload", False), **kwargs)
    streamer, offset = hook
    return streamer.run(offset + i, *args, **kwargs)


def is_streamed(stack):
    """Whether run_block runs the blocks of `stack` (a ModuleList) through a BlockStreamer (a dict lookup: cheap
    enough for every forward, unlike streamer_of's walk)."""
    return stack.__dict__.get(_ATTR) is not None


def streamer_of(module):
    """The BlockStreamer that streams a block stack inside `module` (or `module` itself), or None."""
    for m in module.modules():
        hook = m.__dict__.get(_ATTR)
        if hook is not None:
            return hook[0]
    return None


class _BlockCall:
    """The function a block's checkpoint node runs (and runs again in backward); carries the block's index."""
    __slots__ = ("streamer", "index", "block")

    def __init__(self, streamer, index, block):
        self.streamer, self.index, self.block = streamer, index, block

    def __call__(self, *args, **kwargs):
        return self.block(*args, **kwargs)


class _BlockCheckpoint(CheckpointFunction):
    """flame_core's checkpoint with the streamer told when the block's backward starts and ends."""

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.run
        call.streamer._before_backward(call.index)
        out = CheckpointFunction.backward(ctx, *grads)
        call.streamer._after_backward(call.index)
        return out


def _checkpointed(call, args, kwargs, offload):
    return _BlockCheckpoint.run(call, args, kwargs, preserve_rng_state=True, offload=offload,
                                save=getattr(call.block, "checkpoint_save", ()))


class _Slot:
    __slots__ = ("tensor", "array", "holder", "ready", "last_use", "read_by")

    def __init__(self, nbytes, device):
        self.tensor, self.array = device_bytes(nbytes, device)
        self.holder = None   # index of the block whose weights the slot holds (or is receiving)
        self.ready = None    # copy-stream event after that block's copy
        self.read_by = None  # write-back event of a layer-wise update still reading the slot (write_back)
        self.last_use = -1


class BlockStreamer:
    """Stream the weights of `blocks` (a ModuleList, or a list of them run one after the other) through `slots` GPU
    slot buffers; blocks in `resident` keep their weights on the GPU.

    device          the GPU (or cpu) the blocks compute on; default: the default device
    quantize        "fp8": store each block's frozen Linear weights as float8_e4m3fn with per-output-channel scales
                    (done block by block on `device` before packing; halves memory and transfer)
    fp8_compute     with quantize="fp8": one scale per weight tensor and the blocks' frozen matmuls on the fp8
                    tensor cores (flame_nn.offload.fp8_compute)
    prepare         prepare(block) is called on each block before it is packed (e.g. to load or initialise it block
                    by block, so the whole model never has to be on the GPU at once)
    sources         {module key: host NumPy array}, e.g. `safetensors_views(files)`: tensors found there are copied
                    straight from those arrays (a memory-mapped file) instead of a pinned copy -- for inference
    prefixes        the stacks' names in the model (default: "0", "1", ...), for `sources` keys and `state_dict`
    stream_trainable  stream trainable block parameters too (layer-wise full fine-tuning: LayerwiseOptimizer,
                    LayerwiseAdamW); each block's get lazy gradient buffers of their own
    profile         time every host->device copy (`transfer_log()`)
    offload_activations  keep the checkpointed block inputs carried from block to block in pinned host memory
                    between forward and backward (flame_nn.offload.activations; every block is then checkpointed);
                    auto_fit turns it on when the budget needs it

    The weights of a streamed block read as NaN outside the streamer. Do not call `.to()` on the model afterwards
    (it would copy placeholders); move the other modules yourself, or build the streamer after moving the model.
    """

    def __init__(self, blocks, *, resident=(), slots=2, device=None, quantize=None, prepare=None, sources=None,
                 prefixes=None, stream_trainable=False, profile=False, fp8_compute=False, offload_activations=False):
        stacks = [blocks] if isinstance(blocks, Module) else list(blocks)
        if not stacks:
            raise OffloadError("BlockStreamer needs at least one stack of blocks")
        if int(slots) < 1:
            raise OffloadError(f"BlockStreamer needs at least one slot, got slots={slots}")
        if quantize not in (None, "fp8", "float8_e4m3fn"):
            raise OffloadError(f"quantize must be None or 'fp8', got {quantize!r}")
        if fp8_compute and quantize is None:
            raise OffloadError("fp8_compute needs quantize='fp8' (the fp8 GEMM reads the fp8 weights)")
        self._fp8_compute = bool(fp8_compute)
        if prefixes is not None and len(prefixes) != len(stacks):
            raise OffloadError(f"{len(prefixes)} prefixes for {len(stacks)} stacks")
        self.device = _parse_device(device) if device is not None else default_device()
        self.quantize = quantize
        self.outside_modules = {}  # {name: module} of the model outside the stacks (for_model), for outside fp8
        self.outside_fp8 = []      # the names of those Linears stored in fp8 (quantize_outside_)
        self.num_slots = int(slots)
        self.engine = copy_engine(self.device, profile)
        self.blocks, self.names, self._stacks = [], [], []
        for k, st in enumerate(stacks):
            if not isinstance(st, Module):
                raise OffloadError(f"stack {k} is a {type(st).__name__}, not a ModuleList of blocks")
            if st.__dict__.get(_ATTR) is not None:
                raise OffloadError(f"stack {k} already has a BlockStreamer; close() it first")
            prefix = str(prefixes[k]) if prefixes is not None else str(k)
            off = len(self.blocks)
            for j, b in enumerate(st):
                self.blocks.append(b)
                self.names.append(f"{prefix}.{j}")
            self._stacks.append(st)
            object.__setattr__(st, _ATTR, (self, off))
        self._layerwise = None
        self._stale = set()           # resident blocks updated on the device since their host copy was written
        self.weights_on_host = False  # inside on_host: the blocks' tensors are views of their host copies
        self.trace = None  # a list to record the schedule into: ("run" | "backward", i) and ("load", i, slot)
        self.stream_trainable = bool(stream_trainable)
        self.stats = {"loads": 0, "bytes_h2d": 0, "hits": 0}
        self._host = []
        try:
            for i, block in enumerate(self.blocks):
                self._host.append(self._pack(i, block, quantize, prepare, sources))
        except BaseException:
            for hb in self._host:  # give the packed blocks their weights back
                hb.bind(_own_copy(hb, self.engine, self.device)[1])
            self._detach()
            raise
        if self.stream_trainable:
            # each block's trainable tensors get lazy gradient buffers of their own: a layer-wise update releases
            # them block by block, so the whole model's gradients never exist at once (one buffer would hold them)
            from flame_core import grad_pool
            for hb in self._host:
                ps = [e.tensor for e in hb.trainable]
                if ps:
                    grad_pool.unregister(ps)
                    grad_pool.register(ps, lazy=True)
        self._views = [{} for _ in self.blocks]
        self._slots = []
        self._slot_bytes = 0
        self._where = {}      # streamed block -> slot index, for blocks in a slot
        self._own = {}        # resident block -> (tensor, array) of its own device buffer
        self._resident = set()
        self._streamed = list(range(len(self.blocks)))
        self._clock = itertools.count()
        self._generation = 0  # bumped whenever device buffers are replaced (caches keyed by buffer must drop)
        self._home = {}       # streamed block -> its home slot (position among the streamed blocks mod K)
        self._capture = None  # key of the CUDA graph capture the last streamer call ran in (None: eager)
        self._capture_start = None
        self._forked = False  # the copy stream has joined the current capture
        self.graph_stats = None  # the last capture: {"loads", "bytes_h2d", "start", "end"} (what each replay copies)
        self.activations = None  # the ActivationOffload while offload_activations is on
        self.offload_activations = offload_activations
        self.set_resident(resident)

    @classmethod
    def for_model(cls, model, stacks=None, *, device=None, **kwargs):
        """Stream the block stacks of `model` -- the named ModuleLists `stacks`, default every ModuleList child
        (Flux: double_blocks, single_blocks) -- and move everything else of the model, adapters included, to
        `device`. Keyword arguments go to BlockStreamer; `prefixes` are the stack names."""
        from ..containers import ModuleList
        names = list(stacks) if stacks is not None else [n for n, m in model.named_children()
                                                          if isinstance(m, ModuleList)]
        if not names:
            raise OffloadError(f"{type(model).__name__} has no ModuleList of blocks to stream; name the stacks")
        dev = _parse_device(device) if device is not None else default_device()
        streamer = cls([model.get_submodule(n) for n in names], device=dev, prefixes=names, **kwargs)
        streamer.outside_modules = {n: m for n, m in model.named_children() if n not in names}
        streamed = {id(m) for b in streamer.blocks for m in b.modules()}
        for m in model.modules():
            if id(m) in streamed:
                continue
            for reg in (m._parameters, m._buffers):
                for t in reg.values():
                    if t is not None and not getattr(t, "is_meta", False) and t.device != dev:
                        _move(t, dev)
        for m in model.modules():  # adapters sit outside the module tree (flame_nn.adapters)
            for entries in getattr(m, "_adapters", {}).values():
                for _, ad in entries:
                    ad.to(dev)
        return streamer

    # ------------------------------------------------------------------ construction
    def _pack(self, i, block, quantize, prepare, sources):
        if prepare is not None:
            prepare(block)
        if quantize is not None:
            from .fp8 import quantize_linear_weights_
            if any(p.device != self.device for p in block.parameters() if not p.is_meta):
                block.to(self.device)  # quantise with the device's kernel, one block at a time
            quantize_linear_weights_(block, compute="fp8" if self._fp8_compute else None)
        hb = HostBlock(i, block, self.device, self.stream_trainable, sources, self.names[i] + ".")
        hb.unbind()  # the block's own storage is released here
        for name, p in block.named_parameters():  # parameters that do not stream go to the device
            if p.requires_grad and not self.stream_trainable and not p.is_meta and p.device != self.device:
                _move(p, self.device)
        for m in block.modules():
            if m._meta_check and not any(p is not None and p.is_meta for p in m._parameters.values()):
                m.__dict__["_meta_check"] = False
        return hb

    def _detach(self):
        for st in self._stacks:
            st.__dict__.pop(_ATTR, None)
        self._stacks = []

    # ------------------------------------------------------------------ placement
    @property
    def offload_activations(self):
        return self.activations is not None and not self.activations.count_only

    @offload_activations.setter
    def offload_activations(self, on):
        self._offload_by_fit = False  # (auto_fit marks the ones it turned on itself)
        if bool(on) != self.offload_activations:
            if self.activations is not None:
                self.activations.join()
            self.activations = ActivationOffload(self.device) if on else None

    def quantize_outside_(self):
        """Store the large frozen Linear weights outside the stacks (for_model's model) in fp8; returns the bytes
        saved (flame_nn.offload.outside). auto_fit calls it when the blocks are fp8 and the budget needs the room."""
        from .outside import quantize_outside_
        names, saved = quantize_outside_(self.outside_modules)
        self.outside_fp8 += names
        return saved

    @property
    def resident(self):
        return sorted(self._resident)

    @property
    def streamed(self):
        return list(self._streamed)

    @property
    def generation(self):
        """A counter bumped whenever the device buffers are replaced (set_resident): whatever holds their addresses
        -- a captured CUDA graph -- is stale once it changes."""
        return self._generation

    def block_bytes(self, i):
        """Bytes of block i's streamed tensors (its slot footprint / its resident buffer)."""
        return self._host[i].nbytes

    @property
    def slot_bytes(self):
        return self._slot_bytes

    @property
    def host_pinned_bytes(self):
        """Pinned host memory the blocks' weights take (every block keeps its copy: a resident one can be demoted);
        page-locked, so the host RAM a run needs at least."""
        return sum(hb.pinned_bytes for hb in self._host)

    @property
    def host_mapped_bytes(self):
        """Block weights read from memory-mapped files instead (sources=): page cache the OS may reclaim."""
        return sum(hb.mapped_bytes for hb in self._host)

    def set_resident(self, indices, fresh=False):
        """Keep the blocks `indices` (indices across the stacks, or "all") on the GPU and stream the others.
        fresh: empty the device cache once the old buffers are dropped, so that the slots and the new resident
        buffers get segments of their own (auto_fit does this: no persistent buffer inside a cached activation
        segment)."""
        if self._sync_capture() is not None:
            raise OffloadError("set_resident inside a CUDA graph capture: choose the resident blocks before capturing")
        n = len(self.blocks)
        new = set(range(n)) if indices == "all" else {int(i) for i in indices}
        bad = [i for i in new if not 0 <= i < n]
        if bad:
            raise OffloadError(f"resident block indices {sorted(bad)} are out of range (0..{n - 1})")
        eng = self.engine
        eng.compute_waits(eng.record_copy())  # buffers freed below may still be receiving copies
        self._generation += 1
        if self._resident - new:
            from .fp8_transposes import cache_fp8_transposes_
        if self._stale & (self._resident - new):
            self._flush_stale()                 # (updated in place: the host copy follows before the buffer goes)
            eng.compute_waits(eng.record_copy())
        for i in sorted(self._resident - new):  # demote: drop the block's own buffer, and its kept fp8 W^T (its
            self._host[i].unbind()              # weights now come through a slot: the cache would never be used)
            del self._own[i]
            cache_fp8_transposes_(self.blocks[i], False)
        streamed = [i for i in range(n) if i not in new]
        need = max((self._host[i].nbytes for i in streamed), default=0)
        if need != self._slot_bytes or fresh:
            self._free_slots()
            self._slot_bytes = 0
            if fresh:
                gc.collect()
                _memory.empty_cache(self.device)
            if need:
                self._slots = [_Slot(need, self.device) for _ in range(self.num_slots)]
            self._slot_bytes = need
        for i in sorted(new - self._resident):  # promote: a buffer of its own, filled once
            s = self._where.pop(i, None)
            if s is not None:
                self._slots[s].holder = None
            hb = self._host[i]
            tensor, array, ev = _own_copy(hb, eng, self.device)
            self._own[i] = (tensor, array)
            eng.compute_waits(ev)
            hb.bind(array)
        self._resident = new
        self._streamed = streamed
        self._home = {u: p % self.num_slots for p, u in enumerate(streamed)}
        for k, slot in enumerate(self._slots):  # a block left in a slot that is no longer its home gives it up
            if slot.holder is not None and self._home.get(slot.holder) != k:
                self._host[slot.holder].unbind()
                del self._where[slot.holder]
                slot.holder = None
        return self

    def _free_slots(self):
        for s in self._slots:
            if s.holder is not None:
                self._host[s.holder].unbind()
        self._slots, self._where = [], {}
        for v in self._views:
            v.clear()

    # ------------------------------------------------------------------ running
    def run(self, i, *args, **kwargs):
        """Run block i (index across the stacks) with its weights in place; checkpointed in training when streamed."""
        grad = _grad_state.enabled
        self._begin(i, backward=False, cyclic=not grad)
        block = self.blocks[i]
        acts = self.activations
        if grad and (i not in self._resident or self._layerwise is not None or self.offload_activations
                     or getattr(block, "gradient_checkpointing", False)):
            offload = acts.hooks(i) if acts is not None else getattr(block, "checkpoint_offload", False)
            return _checkpointed(_BlockCall(self, i, block), args, kwargs, offload)
        return block(*args, **kwargs)

    def _before_backward(self, i):
        self._begin(i, backward=True, cyclic=False)
        if self.activations is not None:
            self.activations.prefetch(i)  # block i's inputs, and the next backward's, on the activations' stream
        if self._layerwise is not None:
            self._layerwise._before_backward(i)

    def _after_backward(self, i):
        if self._layerwise is not None:
            self._layerwise._after_backward(i)

    def _window(self, i, backward, cyclic):
        """The next K streamed blocks in the order they will run, starting at block i."""
        S, K = self._streamed, self.num_slots
        if backward:
            pos = bisect.bisect_right(S, i)
            return S[max(0, pos - K):pos][::-1]
        pos = bisect.bisect_left(S, i)
        win = S[pos:pos + K]
        if cyclic and len(win) < K:
            win = list(dict.fromkeys(win + S[:K - len(win)]))
        return win

    def _begin(self, i, backward, cyclic):
        if self.trace is not None:
            self.trace.append(("backward" if backward else "run", i))
        if self._sync_capture() is not None:
            cyclic = False  # a captured step is a training step; no wrapped prefetch for a call after it
        window = self._window(i, backward, cyclic)
        if window:
            self._ensure(window)
        s = self._where.get(i)
        if s is not None:
            slot = self._slots[s]
            self.engine.compute_waits(slot.ready)
            slot.last_use = next(self._clock)

    def _ensure(self, window):
        missing = [u for u in window if u not in self._where]
        self.stats["hits"] += len(window) - len(missing)
        if not missing:
            return
        busy = {self._where[u] for u in window if u in self._where}
        eng = self.engine
        eng.copy_waits(eng.record_compute())  # every earlier use of these slots is enqueued before this point
        if self._capture is not None:
            self._forked = True  # that wait, on an event of the capturing stream, forked the copy stream into it
        for u in missing:
            s = self._home[u]
            if s in busy:  # a wrapped (inference) window: its home is taken by a block of the window
                s = min((k for k in range(len(self._slots)) if k not in busy), key=lambda k: self._slots[k].last_use)
            busy.add(s)
            self._load(u, s)

    def _load(self, u, s):
        """Enqueue the copy of streamed block u into slot s (whose previous block, if any, is unbound)."""
        eng = self.engine
        slot = self._slots[s]
        if slot.holder is not None:
            self._host[slot.holder].unbind()
            del self._where[slot.holder]
        hb = self._host[u]
        eng.copy_waits(slot.read_by)     # a write-back still reading the slot (layer-wise updates)
        eng.copy_waits(hb.written)       # ... or writing the block's host copy
        slot.read_by = hb.written = None
        hb.load(eng, slot.array)
        slot.ready = eng.record_copy()
        slot.holder = u
        self._where[u] = s
        hb.bind(slot.array, self._views[u])
        self.stats["loads"] += 1
        self.stats["bytes_h2d"] += hb.nbytes
        if self._capture is not None and self.graph_stats is not None:
            self.graph_stats["loads"] += 1
            self.graph_stats["bytes_h2d"] += hb.nbytes
        if self.trace is not None:
            self.trace.append(("load", u, s))

    # ------------------------------------------------------------------ CUDA graphs: a cyclic schedule
    def slot_state(self):
        """(block held by slot 0, by slot 1, ...) with None for an empty slot."""
        return tuple(s.holder for s in self._slots)

    def start_state(self):
        """The state a training step starts and ends in: the first K streamed blocks in their home slots."""
        state = [None] * len(self._slots)
        for u in self._streamed[:len(self._slots)]:
            state[self._home[u]] = u
        return tuple(state)

    def prime(self):
        """Put the streamer in `start_state()` (loading what is missing, eagerly) and order everything the copy stream
        has done before what the compute stream does next. Call it before each replay of a captured step when
        anything else may have used the streamer since the last step (the trainer calls it before every step);
        when the state is already right it costs one event. Not inside a capture."""
        if self._sync_capture() is not None:
            raise OffloadError("prime() inside a CUDA graph capture: call it before the captured step")
        if self._streamed:
            want = self.start_state()
            have = self.slot_state()
            if have != want:
                eng = self.engine
                eng.copy_waits(eng.record_compute())
                for s, u in enumerate(want):
                    if u is not None and have[s] != u:
                        if u in self._where:  # the block sits in another slot: give that one up
                            other = self._slots[self._where.pop(u)]
                            other.holder = None
                            self._host[u].unbind()
                        self._load(u, s)
        self.join()
        return self

    def join(self):
        """Make the compute stream wait for everything enqueued on the copy stream so far. At the end of a captured
        region this joins the copy stream's branch of the graph back into the capturing stream (the schedule joins
        each copy when its block runs; this covers whatever it did not), and checks that the step left the slots as
        it found them (a replay would otherwise compute with the wrong weights)."""
        cap = self._sync_capture()
        eng = self.engine
        if cap is None or self._forked:  # (a copy stream outside the capture has nothing to join)
            eng.compute_waits(eng.record_copy())
        for s in self._slots:
            s.ready = None  # complete before anything the compute stream runs from here on
        if self.activations is not None:
            self.activations.join()
        if cap is not None and self.graph_stats is not None:
            end = self.slot_state()
            self.graph_stats["end"] = end
            if end != self._capture_start:
                raise OffloadError(f"the captured step is not cyclic: it started with slots holding blocks "
                                   f"{self._capture_start} and ended with {end}, so a replay would read other "
                                   f"blocks' weights; capture a training step (forward + backward) after prime()")
        return self

    def _sync_capture(self):
        """Notice a CUDA graph capture beginning or having ended since the last streamer call; returns its key."""
        capturing = getattr(self.engine, "capturing", None)
        cap = capturing() if capturing is not None else None
        if cap == self._capture:
            return cap
        # Events may not cross a capture boundary. Entering: everything before the capture is complete when the graph
        # runs (capture begins on a synchronised device; prime() orders later eager copies before each replay).
        # Leaving: eager work after a replay is ordered after it on the compute stream.
        for s in self._slots:
            s.ready = s.read_by = None
        stats, was = self.graph_stats, self._capture
        self._capture = cap
        if was is not None and stats is not None and stats["end"] is None:
            end = stats["end"] = self.slot_state()  # no streamer call ran since that capture ended
            if end != stats["start"]:
                raise OffloadError(f"a CUDA graph captured a streamed region that is not cyclic (slots held blocks "
                                   f"{stats['start']} at its start and {end} at its end): its replays computed with "
                                   f"other blocks' weights. Capture training steps (forward + backward) and call "
                                   f"streamer.join() at the end of the captured function")
        if cap is not None:
            if self._layerwise is not None:
                raise OffloadError("a streamer with a layer-wise optimizer cannot be captured in a CUDA graph: its "
                                   "updates make host round trips inside backward")
            self._capture_start = self.slot_state()
            self._forked = False
            self.graph_stats = {"loads": 0, "bytes_h2d": 0, "start": self._capture_start, "end": None}
        return cap

    def invalidate_slots(self):
        """Forget what the slots hold (the next use loads again). For after a capture that failed part-way: the
        streamer recorded loads that never ran."""
        capturing = getattr(self.engine, "capturing", None)
        self._capture = capturing() if capturing is not None else None
        self.graph_stats = None
        self._forked = False
        for slot in self._slots:
            if slot.holder is not None:
                self._host[slot.holder].unbind()
                del self._where[slot.holder]
            slot.holder = slot.ready = None
        return self

    # ------------------------------------------------------------------ introspection and teardown
    def reset_stats(self):
        self.stats = {"loads": 0, "bytes_h2d": 0, "hits": 0}
        self.engine.transfer_log()

    def transfer_log(self):
        """[(seconds, bytes)] of every host->device copy since the last call (needs profile=True)."""
        return self.engine.transfer_log()

    def write_back(self, i, entries):
        """Block i's `entries` (its HostBlock's) were updated on the device, in the buffer the block is bound to: the
        host copy follows -- a streamed block's now, on the engine's write-back stream behind the update (the slot's
        next load and the block's own wait for it), a resident block's when the host copy is next read (state_dict,
        on_host, close, a demotion): its own buffer stays the weights it computes with. A layer-wise optimizer calls
        it after each block's update."""
        hb = self._host[i]
        if i in self._resident:
            self._stale.add(i)
            return
        # on the write-back stream (device->host beside the host->device loads); the slot's next load and the
        # block's own next load wait for it
        eng = self.engine
        eng.writeback_waits(eng.record_compute())
        for e in entries:
            eng.writeback(hb.host[e.offset:e.offset + e.nbytes], hb.bound, e.offset)
        done = eng.record_writeback()
        self._slots[self._where[i]].read_by = done
        hb.written = done

    def _flush_stale(self):
        """Enqueue the host copies of the resident blocks updated since they were last written (write_back)."""
        if not self._stale:
            return
        eng = self.engine
        eng.copy_waits(eng.record_compute())
        for i in sorted(self._stale):
            hb, own = self._host[i], self._own[i][1]
            for e in hb.trainable:
                eng.d2h(hb.host[e.offset:e.offset + e.nbytes], own, e.offset)
        self._stale.clear()

    def synchronize(self):
        """Wait for the copy stream (host buffers are then safe to read; pending write-backs are written first)."""
        self._flush_stale()
        self.engine.synchronize()

    def state_dict(self):
        """{'<prefix>.<j>.<name>': cpu Tensor} of every streamed tensor (copies of the host weights)."""
        from flame_core import as_tensor
        self.synchronize()
        out = {}
        for name, hb in zip(self.names, self._host):
            for k, arr in hb.host_arrays().items():
                out[f"{name}.{k}"] = as_tensor(arr.copy())
        return out

    @contextlib.contextmanager
    def on_host(self):
        """Within the block every block's tensors are views of their host copies: NumPy arrays, so cpu tensors,
        writable where pinned -- a layer-wise full fine-tune's weights read for a save or written by a resume, with
        no device copy of the model. Pending copies finish first; afterwards the resident blocks' buffers are
        filled again from the host copies (a write there lands on the device) and the streamed blocks load again
        at their next use."""
        if self._sync_capture() is not None:
            raise OffloadError("on_host inside a CUDA graph capture")
        eng = self.engine
        eng.copy_waits(eng.record_compute())   # (updates queued on the compute stream reach the copies' sources)
        self.synchronize()
        self.invalidate_slots()                # every slot's block unbound, the slots empty
        try:
            for hb in self._host:
                hb.bind_host()
            self.weights_on_host = True
            yield self
        finally:
            self.weights_on_host = False
            for hb in self._host:
                hb.unbind()
            eng.copy_waits(eng.record_compute())
            for i, (_, array) in sorted(self._own.items()):
                hb = self._host[i]
                hb.load(eng, array)
                hb.bind(array)
            eng.compute_waits(eng.record_copy())

    def close(self, device=None):
        """Stop streaming: every block's tensors get arrays of their own on `device` (default: the streamer's)."""
        dev = _parse_device(device) if device is not None else self.device
        self.synchronize()
        self.engine.compute_waits(self.engine.record_copy())
        for hb in self._host:
            arrays = hb.host_arrays()
            for e in hb.entries:
                arr, f8 = convert(arrays[e.name], None, dev)
                if arr is arrays[e.name] or getattr(arr, "base", None) is not None:
                    arr = arr.copy()
                e.tensor.set_array_(arr, f8)
                e.tensor._version[0] += 1
        self._free_slots()
        self._own.clear()
        self.offload_activations = False
        self.activations = None
        self._resident, self._streamed = set(), []
        self._host = []
        if self._layerwise is not None:
            self._layerwise._streamer = None
            self._layerwise = None
        self._detach()

    def __len__(self):
        return len(self.blocks)

    def __repr__(self):
        gib = 2 ** 30
        res = sum(self._host[i].nbytes for i in self._resident)
        st = sum(self._host[i].nbytes for i in self._streamed)
        return (f"BlockStreamer({len(self.blocks)} blocks on {self.device}: {len(self._resident)} resident "
                f"({res / gib:.2f} GiB), {len(self._streamed)} streamed ({st / gib:.2f} GiB) through "
                f"{self.num_slots if self._streamed else 0} slots of {self._slot_bytes / gib:.3f} GiB)")

    def auto_fit(self, max_gpu_memory, step_fn, **kwargs):
        """Choose the resident blocks for a memory budget by measuring `step_fn`; see flame_nn.offload.auto_fit."""
        from .autofit import auto_fit
        return auto_fit(self, max_gpu_memory, step_fn, **kwargs)


def _move(t, device):
    """Move tensor `t` (a parameter or buffer) to `device` in place, as Module.to does."""
    from flame_core import grad_pool
    registered = grad_pool.is_registered(t)
    if registered:
        lazy = grad_pool.buffer_of(t).lazy
        grad_pool.unregister([t])
    t.set_array_(*convert(t.array, None, device, t._f8))
    t._version[0] += 1
    if t._grad is not None:
        t._grad = None
    if registered:
        grad_pool.register([t], lazy=lazy)


def _own_copy(hb, engine, device):
    """A device buffer of its own for host block `hb`, the copy into it enqueued: (tensor, array, copy event)."""
    tensor, array = device_bytes(hb.nbytes, device)
    engine.copy_waits(engine.record_compute())  # the new buffer's previous users (pool reuse) are done first
    engine.copy_waits(hb.written)               # (a layer-wise update's write-back of the host copy)
    hb.written = None
    hb.load(engine, array)
    return tensor, array, engine.record_copy()
