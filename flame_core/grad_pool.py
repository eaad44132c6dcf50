"""Gradient buffer pool: parameter gradients live in flat, pre-allocated buffers, one per (device, dtype) and
`register` call; each `.grad` is a view into its buffer.

    grad_pool.register(model.parameters())     # flame_nn Module / optimizers call this
    loss.backward()                             # leaf gradients are written into the views (copy, then +=)
    grad_pool.zero_grad()                       # one memset per flat buffer
    buf = grad_pool.flat_buffer_of(param)       # the 1-D Tensor its gradient lives in (fused optimizers, all-reduce)
    grad_pool.pooled_grad(param)                # the view of buf backward writes `param`'s gradient into
    grad_pool.register(lora_params, lazy=True)  # storage only while gradients exist (PyTorch's memory behaviour)

Backward never allocates `.grad` storage for a registered parameter: the first gradient is copied into the view,
later ones are added in place. `zero_grad(set_to_none=True)` sets `.grad` to None (the next backward copies instead
of adding) and still clears the storage (one memset), so the flat buffer never holds a stale gradient. Each
parameter's slice starts on a 256-byte boundary; the gaps are zero and stay zero. A gradient that must keep its graph
(`create_graph=True`), or a `.grad` the user replaced by another tensor, takes the ordinary path.
Parameters registered later go into new buffers; a buffer lives as long as any of its parameters.

`register(params, lazy=True)` gives PyTorch's memory behaviour at the flat buffers' speed: the parameters go, in
registration order, into buffers of at most LAZY_CHUNK_BYTES each -- or 1/LAZY_CHUNKS of their gradients' bytes when
that is more: a full fine-tune's gigabytes of gradients in ~64 buffers, not thousands, so the step's per-buffer work
(the finite check, the norm for clipping, a fused optimizer's launch) stays a few dozen operations --, whose storage
is allocated (zeroed) when backward writes the first gradient into one of its slots and released when
`zero_grad(set_to_none=True)` leaves none of its slots a gradient. So the gradients are not resident before
backward, and during backward only the buffers of the parameters reached so far are (a LoRA's 71 MiB of fp32
gradients on Flux-dev would otherwise sit under the activations at the step's peak). Inside a CUDA graph capture
the storage comes from the graph's private memory, where it shares addresses with activations freed earlier in the
step; it stays (set_to_none only zeroes it) while that graph lives, because every replay writes the gradients there.
`buffer.tensor` of a lazy buffer without storage allocates it (zeroed): a consumer always sees a valid, zero-gapped
flat buffer.
"""
import weakref

from . import backend
from .autograd import engine
from .errors import AutogradError, fmt_shape
from .tensor import Tensor, _wrap

ALIGN_BYTES = 256
LAZY_CHUNK_BYTES = 4 << 20  # a lazy buffer's size: the most gradient storage resident ahead of its first gradient
LAZY_CHUNKS = 64  # ... or 1/64 of a registration's gradient bytes when that is larger (lazy buffers per register)

_slots = {}  # id(param) -> _Slot
_buffers = weakref.WeakSet()


class FlatBuffer:
    """One flat gradient buffer of `numel` elements: `tensor` (1-D) and the slots of the parameters whose gradients
    it holds. `lazy`: storage only while a slot holds a gradient (see the module docstring)."""
    __slots__ = ("_tensor", "device", "dtype", "numel", "slots", "lazy", "_graph", "__weakref__")

    def __init__(self, device, dtype, numel, slots, lazy=False):
        self.device, self.dtype, self.numel, self.slots, self.lazy = device, dtype, int(numel), slots, bool(lazy)
        self._tensor = None
        self._graph = None  # weakref to the CUDA graph whose capture allocated the storage

    @property
    def tensor(self):
        """The 1-D buffer (a lazy buffer without storage gets it now, zeroed)."""
        if self._tensor is None:
            self._allocate()
        return self._tensor

    @property
    def resident(self):
        """Whether the storage exists (always, unless lazy)."""
        return self._tensor is not None

    def _allocate(self):
        xp = backend.xp_for(self.device)
        with self.device.context():
            flat = xp.zeros(self.numel, dtype=self.dtype.np)  # inside a capture: the memset is captured too
        self._tensor = _wrap(flat)
        self._graph = _capturing_graph(flat)
        for s in self.slots:
            s.view = _wrap(flat[s.offset:s.offset + s.numel].reshape(s.shape))

    def _release(self):
        """Drop a lazy buffer's storage (every slot's gradient is None), unless a live CUDA graph writes into it."""
        g = self._graph() if self._graph is not None else None
        if g is not None and g.is_live:
            return False
        self._tensor = self._graph = None
        for s in self.slots:
            s.view = None
        return True

    def live_slots(self):
        return [s for s in self.slots if s.ref() is not None]


def forget_capture(cuda_graph):
    """A capture of `cuda_graph` failed: its work never ran, so the lazy buffers it allocated hold no gradient (not
    even the zeros their `.grad` were set to). Drop them: their parameters' `.grad` become None again."""
    for buf in list(_buffers):
        if buf._graph is not None and buf._graph() is cuda_graph:
            for s in buf.live_slots():
                s.ref()._grad = None
            buf._graph = None
            buf._release()


def _capturing_graph(arr):
    """A weakref to the CUDAGraph capturing on the current stream when `arr` is a CUDA array made during a capture."""
    if not backend.is_cuda_array(arr):
        return None
    from .cuda.graphs import capturing_graph
    g = capturing_graph()
    return None if g is None else weakref.ref(g)


class _Slot:
    __slots__ = ("ref", "buffer", "offset", "numel", "shape", "view")


def _drop(ref, key):
    slot = _slots.get(key)
    if slot is not None and slot.ref is ref:
        del _slots[key]
        slot.buffer.slots.remove(slot)  # no slot -> buffer -> slot cycle: the buffer dies with its last param


def _slot_of(p):
    slot = _slots.get(id(p))
    return slot if slot is not None and slot.ref() is p else None


def register(params, lazy=False):
    """Give the parameters (leaf tensors requiring grad) pooled gradient storage. Returns the new FlatBuffers.
    lazy: buffers of at most LAZY_CHUNK_BYTES whose storage exists only while they hold gradients (module
    docstring)."""
    group = {}
    seen = set()
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"grad_pool.register expects Tensors, got {type(p).__name__}")
        if not (p.is_leaf and p.requires_grad) or id(p) in seen or _slot_of(p) is not None:
            continue
        seen.add(id(p))
        group.setdefault((p.device, p.dtype), []).append(p)
    made = []
    for (dev, dt), ps in group.items():
        align = max(1, ALIGN_BYTES // dt.itemsize)
        chunk = max(LAZY_CHUNK_BYTES // dt.itemsize, sum(p.numel() for p in ps) // LAZY_CHUNKS) if lazy else None
        layouts, offsets, total = [], [], 0
        for p in ps:
            n = (p.numel() + align - 1) // align * align
            if chunk is not None and offsets and total + n > chunk:  # this chunk is full: the next buffer
                layouts.append((offsets, total))
                offsets, total = [], 0
            offsets.append(total)
            total += n
        layouts.append((offsets, total))
        start = 0
        for offsets, total in layouts:
            made.append(_make_buffer(dev, dt, ps[start:start + len(offsets)], offsets, total, lazy))
            start += len(offsets)
    if made:
        engine.leaf_grad_sink = _sink
    return made


def _make_buffer(dev, dt, ps, offsets, total, lazy):
    buf = FlatBuffer(dev, dt, total, [], lazy)
    for p, off in zip(ps, offsets):
        s = _Slot()
        s.buffer, s.offset, s.numel, s.shape, s.view = buf, off, p.numel(), p._data.shape, None
        key = id(p)
        s.ref = weakref.ref(p, lambda r, key=key: _drop(r, key))
        _slots[key] = s
        buf.slots.append(s)
    if not lazy or any(p._grad is not None for p in ps):
        buf._allocate()
    for p, s in zip(ps, buf.slots):
        if p._grad is not None:  # keep an existing gradient's values
            s.view._data[...] = p._grad._data
            p._grad = s.view
    _buffers.add(buf)
    return buf


def unregister(params):
    """Stop pooling these parameters' gradients (an existing `.grad` view stays valid)."""
    for p in params:
        s = _slot_of(p)
        if s is not None:
            del _slots[id(p)]
            s.buffer.slots.remove(s)


def is_registered(param):
    return _slot_of(param) is not None


def _sink(leaf, g):
    """Store the gradient of a registered leaf into its view. Called by the autograd engine."""
    s = _slots.get(id(leaf))
    if s is None or s.ref() is not leaf or g._grad_fn is not None:
        return False
    cur = leaf._grad
    gd = g._data
    if gd.shape != s.shape:
        return False
    if s.view is None:  # a lazy buffer's first gradient: its storage now (the other slots' gradients are None)
        s.buffer._allocate()
    view = s.view
    if cur is None:
        backend.copy_into(view._data, gd)
        leaf._grad = view
    elif cur is view:
        view._data += gd
    else:
        return False
    return True


def _memset(arr):
    if backend.is_cuda_array(arr):
        arr.data.memset_async(0, arr.nbytes)
    else:
        arr.fill(0)


def zero_grad(params=None, set_to_none=False):
    """Zero the gradients of `params` (default: every registered parameter).

    A flat buffer whose parameters are all included is cleared with one memset; others slice by slice.
    Unregistered parameters get PyTorch's behaviour. With `set_to_none=True` every `.grad` becomes None and the pooled
    storage is cleared as well: a consumer of `flat_buffer_of(p)` (fused optimizer, all-reduce, clipping) must not see
    last step's values for a parameter that gets no gradient this step.
    """
    if params is None:
        for buf in list(_buffers):
            _clear(buf, buf.live_slots(), True, set_to_none)
        return
    by_buf = {}
    for p in params:
        s = _slot_of(p)
        if s is None:
            if set_to_none:
                p._grad = None
            elif p._grad is not None:
                p._grad._data.fill(0)
                p._grad._version[0] += 1
            continue
        by_buf.setdefault(id(s.buffer), (s.buffer, []))[1].append(s)
    for buf, slots in by_buf.values():
        _clear(buf, slots, len(slots) == len(buf.live_slots()), set_to_none)


def _clear(buf, slots, whole, set_to_none):
    if not buf.resident:  # a lazy buffer without storage: no slot holds a gradient
        return
    if set_to_none:
        for s in slots:
            s.ref()._grad = None
        if buf.lazy and all(s.ref()._grad is None for s in buf.live_slots()) and buf._release():
            return
    if whole:
        _memset(buf.tensor._data)
    else:
        for s in slots:
            _memset(s.view._data)
    for s in slots:
        s.view._version[0] += 1


def _require(param):
    s = _slot_of(param)
    if s is None:
        raise AutogradError(f"parameter of shape {fmt_shape(param.shape)}, dtype {param.dtype}, device {param.device} "
                         f"is not registered in the gradient pool; call flame_core.grad_pool.register(params) first")
    return s


def buffer_of(param):
    """The FlatBuffer that holds `param`'s gradient (stable while `param` is registered; a lazy buffer's storage
    behind it comes and goes)."""
    return _require(param).buffer


def flat_buffer_of(param):
    """The 1-D Tensor that holds `param`'s gradient (shared storage; for fused optimizers and all-reduce)."""
    return _require(param).buffer.tensor


def pooled_grad(param):
    """The view of `flat_buffer_of(param)` that backward stores `param`'s gradient in: `param.grad` is this very
    Tensor while the gradient is pooled (all-reduce checks that, and makes it `.grad` where this rank produced no
    gradient but the reduced buffer holds one)."""
    s = _require(param)
    if s.view is None:  # a lazy buffer without storage
        s.buffer._allocate()
    return s.view


def slice_of(param):
    """(offset, numel) of `param`'s gradient inside `flat_buffer_of(param)`, in elements."""
    s = _require(param)
    return s.offset, s.numel


def buffers():
    """Every live FlatBuffer."""
    return list(_buffers)
