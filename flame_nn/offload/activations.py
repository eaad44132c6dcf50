"""Activation offload: the block inputs gradient checkpointing keeps between forward and backward, carried in pinned
host memory instead of on the GPU (`BlockStreamer(..., offload_activations=True)`; auto_fit turns it on when a budget
needs it). For Flux-dev at 1024² that is 56 blocks x ~27 MiB, ~1.5 GiB of device memory a step does not hold.

Which inputs: those a block does not share with the block that ran before it -- the activations carried from block to
block (Flux: img and txt, then x). Inputs every block reads (the conditioning vector, the rotary table) stay where they
are: they are alive anyway, and copying them would free nothing. The first block of a forward keeps its inputs.

The schedule, on a copy stream of its own (device->host copies then overlap the weight stream's host->device ones):
  forward, block i     the copy stream waits on an event recorded on the compute stream (the inputs are written),
                       copies each carried input into its pinned buffer, records an event; the compute stream waits
                       on block i-1's event and only then drops block i-1's device inputs, so the pool hands their
                       memory to later kernels only after the copy read it
  backward, block i    (called by the streamer before the block's recompute) the inputs of block i, if not yet on
                       their way, and of the block whose backward comes next are copied back into fresh device arrays
                       (the copy stream first waits on the compute stream: the pool may hand out memory earlier kernels
                       still use); the compute stream waits on block i's event before the recompute reads them
Every pinned buffer belongs to one (block, input) and is reused every step, so a CUDA graph captured over the step
replays the same copies: the copies and events are captured like the weight stream's (a wait on a compute event forks
the copy stream into the capture; the compute stream's waits join it back; `join()` covers the rest). Events never
cross a capture boundary (forgotten there; a capture starts on a synchronised device).
One backward per forward: a second forward before the backward reuses the buffers, and a backward then reading the
first one's inputs raises OffloadError.
"""
import numpy as np

from flame_core import as_tensor, backend

from .engine import copy_engine
from .host import OffloadError


class _Saved:
    """What one block's checkpoint node keeps: per input, the tensor itself or the pinned buffer holding it."""
    __slots__ = ("index", "forward", "items")

    def __init__(self, index, forward, items):
        self.index, self.forward, self.items = index, forward, items  # items: [("keep", t) | ("host", k, shape, dt)]


class _BlockHooks:
    """The `offload` object flame_core's checkpoint calls for one block: pack(tensors), later unpack(packed)."""
    __slots__ = ("store", "index")

    def __init__(self, store, index):
        self.store, self.index = store, index

    def pack(self, tensors):
        return self.store.pack(self.index, tensors)

    def unpack(self, saved):
        return self.store.unpack(saved)


class ActivationOffload:
    """The pinned buffers and copy schedule of offloaded block inputs on `device` (see the module docstring).

    engine      the copy engine (default: a copy stream of its own)
    prefetch    how many blocks ahead of the running one backward brings back (default 1)
    count_only  decide what would be offloaded and count its bytes, copy nothing (auto_fit's planning step)
    """

    def __init__(self, device, engine=None, prefetch=1, count_only=False):
        self.device = device
        self.engine = engine if engine is not None else copy_engine(device)
        self.prefetch_depth = max(0, int(prefetch))
        self.count_only = bool(count_only)
        self._buffers = {}   # (block, input position) -> pinned uint8 host array, reused every step
        self._pending = []   # [(event, [device arrays])]: device->host copies whose sources must outlive them
        self._saved = {}     # block -> _Saved of the current forward
        self._fetched = {}   # block -> (event, {position: device array}) on their way back
        self._order = []     # blocks packed in the current forward, in run order
        self._pos = {}
        self._prev = {}      # id -> tensor: the inputs of the block packed last (shared inputs stay on the device)
        self._last = None
        self._forward = 0
        self._capture = None
        self._forked = False
        self.trace = None  # a list to record the schedule into: ("offload", block) and ("fetch", block)
        self.reset_stats()

    # ------------------------------------------------------------------ bookkeeping
    def hooks(self, index):
        return _BlockHooks(self, index)

    def reset_stats(self):
        """stats: tensors and bytes offloaded, bytes brought back, and the largest block's offloaded bytes."""
        self.stats = {"tensors": 0, "bytes_d2h": 0, "bytes_h2d": 0, "block_max": 0, "bytes_step": 0}

    @property
    def host_bytes(self):
        """Pinned host memory held for the offloaded inputs."""
        return sum(b.nbytes for b in self._buffers.values())

    def _sync(self):
        """Notice a CUDA graph capture starting or ending: events recorded on one side are forgotten on the other."""
        capturing = getattr(self.engine, "capturing", None)
        cap = capturing() if capturing is not None else None
        if cap != self._capture:
            self._capture, self._forked = cap, False
            self._pending = []  # a capture starts on (and a replay ends with) the device's work ordered before
            self._fetched = {k: (None, a) for k, (_, a) in self._fetched.items()}

    def _fork(self):
        eng = self.engine
        eng.copy_waits(eng.record_compute())
        if self._capture is not None:
            self._forked = True

    def _start_forward(self):
        self._release_pending()
        self._forward += 1
        self._saved, self._fetched, self._order, self._pos, self._prev = {}, {}, [], {}, {}
        self.stats["bytes_step"] = 0

    def _release_pending(self, keep_last=False):
        keep = self._pending[-1:] if keep_last else []
        for ev, _ in self._pending[:len(self._pending) - len(keep)]:
            self.engine.compute_waits(ev)  # the copy has read the source: its memory may go back to the pool
        self._pending = keep

    def _buffer(self, key, nbytes):
        from flame_core.memory import pinned_pool
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes != nbytes:
            if self._capture is not None:
                raise OffloadError(f"block {key[0]}: input {key[1]} needs a new pinned buffer ({nbytes} bytes) inside "
                                   f"a CUDA graph capture; run the step eagerly once first (shapes must not change)")
            buf = self._buffers[key] = pinned_pool().empty((int(nbytes),), np.uint8)
        return buf

    # ------------------------------------------------------------------ forward
    def pack(self, index, tensors):
        self._sync()
        if self._last is None or index <= self._last:
            self._start_forward()
        first = self._last is None or not self._prev
        self._last = index
        prev, self._prev = self._prev, {id(t): t for t in tensors}
        items, copies, nbytes = [], [], 0
        on_device = backend.is_cuda_array if self.device.type == "cuda" else (lambda a: not backend.is_cuda_array(a))
        for k, t in enumerate(tensors):
            if first or id(t) in prev or t._f8 or not on_device(t.array):  # (an input elsewhere stays where it is)
                items.append(("keep", t.detach()))
                continue
            items.append(("host", k, tuple(t.shape), t.array.dtype))
            copies.append((k, t))
            nbytes += t.array.nbytes
        self.stats["block_max"] = max(self.stats["block_max"], nbytes)
        self.stats["bytes_step"] += nbytes
        if self.count_only:
            return _Saved(index, self._forward, [("keep", t.detach()) for t in tensors])
        if copies:
            self._fork()  # the inputs are written before the copy stream reads them
            sources = []
            xp = backend.xp_for(self.device)
            for k, t in copies:
                src = xp.ascontiguousarray(t.array)
                host = self._buffer((index, k), src.nbytes)
                self.engine.d2h(host, src.reshape(-1).view(np.uint8), 0)
                sources.append(src)
            self._pending.append((self.engine.record_copy(), sources))
            if self.trace is not None:
                self.trace.append(("offload", index))
            self.stats["tensors"] += len(copies)
            self.stats["bytes_d2h"] += nbytes
            self._release_pending(keep_last=True)  # the previous block's copies had a block's compute to finish
        saved = _Saved(index, self._forward, items)
        self._saved[index] = saved
        self._pos[index] = len(self._order)
        self._order.append(index)
        return saved

    # ------------------------------------------------------------------ backward
    def prefetch(self, index):
        """Bring back block `index`'s inputs, if not on their way yet, and those of the next `prefetch` blocks in
        backward order (the streamer calls this as block `index`'s backward starts)."""
        self._sync()
        self._prev = {}  # the forward is over: its last block's inputs must not outlive their copy (one block more
        # on the device through the whole backward, the H200 test's 4 of 5 blocks saved)
        if self.count_only or index not in self._pos:
            return
        self._release_pending()
        p = self._pos[index]
        want = [self._order[q] for q in range(p, max(-1, p - 1 - self.prefetch_depth), -1)]
        missing = [j for j in want if j not in self._fetched and any(it[0] == "host" for it in self._saved[j].items)]
        if not missing:
            return
        xp = backend.xp_for(self.device)
        arrays = {}
        with self.device.context():  # tensors at once: the cpu accounting then counts them as the cuda pool does
            for j in missing:
                arrays[j] = {it[1]: as_tensor(xp.empty(it[2], dtype=it[3])) for it in self._saved[j].items
                             if it[0] == "host"}
        self._fork()  # the fresh arrays' memory may still be read or written by kernels enqueued before
        for j in missing:
            for k, t in arrays[j].items():
                host = self._buffers[(j, k)]
                self.engine.h2d(t.array.reshape(-1).view(np.uint8), 0, host)
                self.stats["bytes_h2d"] += host.nbytes
            self._fetched[j] = (self.engine.record_copy(), arrays[j])
            if self.trace is not None:
                self.trace.append(("fetch", j))

    def unpack(self, saved):
        """The block's inputs (device tensors) for its recompute."""
        self._sync()
        if saved.forward != self._forward:
            raise OffloadError(f"block {saved.index}: its offloaded inputs were overwritten by a later forward "
                               f"(offload_activations keeps one forward's inputs: run backward before the next "
                               f"forward, or turn offload_activations off)")
        if any(it[0] == "host" for it in saved.items):
            if saved.index not in self._fetched:
                self.prefetch(saved.index)
            ev, arrays = self._fetched.pop(saved.index)
            self.engine.compute_waits(ev)
        out = [it[1] if it[0] == "keep" else arrays[it[1]] for it in saved.items]
        self._saved.pop(saved.index, None)
        return out

    def join(self):
        """Make the compute stream wait for everything on the copy stream (eagerly, or inside a capture once the
        copy stream has joined it); forgets the copies' events."""
        self._sync()
        if self._capture is None or self._forked:
            self.engine.compute_waits(self.engine.record_copy())
        self._pending = []
        self._fetched = {k: (None, a) for k, (_, a) in self._fetched.items()}
