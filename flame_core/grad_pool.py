"""Gradient buffer pool: parameter gradients live in flat, pre-allocated buffers, one per (device, dtype) and
`register` call; each `.grad` is a view into its buffer.

    grad_pool.register(model.parameters())     # flame_nn Module / optimizers call this
    loss.backward()                             # leaf gradients are written into the views (copy, then +=)
    grad_pool.zero_grad()                       # one memset per flat buffer
    buf = grad_pool.flat_buffer_of(param)       # the 1-D Tensor its gradient lives in (fused optimizers, all-reduce)
    grad_pool.pooled_grad(param)                # the view of buf backward writes `param`'s gradient into

Backward never allocates `.grad` storage for a registered parameter: the first gradient is copied into the view,
later ones are added in place. `zero_grad(set_to_none=True)` sets `.grad` to None (the next backward copies instead
of adding) and still clears the storage (one memset), so the flat buffer never holds a stale gradient. Each
parameter's slice starts on a 256-byte boundary; the gaps are zero and stay zero. A gradient that must keep its graph
(`create_graph=True`), or a `.grad` the user replaced by another tensor, takes the ordinary path.
Parameters registered later go into new buffers; a buffer lives as long as any of its parameters.
"""
import weakref

from . import backend
from .autograd import engine
from .errors import AutogradError, fmt_shape
from .tensor import Tensor, _wrap

ALIGN_BYTES = 256

_slots = {}  # id(param) -> _Slot
_buffers = weakref.WeakSet()


class FlatBuffer:
    """One flat gradient buffer: `tensor` (1-D) and the slots of the parameters whose gradients it holds."""
    __slots__ = ("tensor", "device", "dtype", "slots", "__weakref__")

    def __init__(self, tensor, slots):
        self.tensor, self.slots = tensor, slots
        self.device, self.dtype = tensor.device, tensor.dtype

    def live_slots(self):
        return [s for s in self.slots if s.ref() is not None]


class _Slot:
    __slots__ = ("ref", "buffer", "offset", "numel", "view")


def _drop(ref, key):
    slot = _slots.get(key)
    if slot is not None and slot.ref is ref:
        del _slots[key]
        slot.buffer.slots.remove(slot)  # no slot -> buffer -> slot cycle: the buffer dies with its last param


def _slot_of(p):
    slot = _slots.get(id(p))
    return slot if slot is not None and slot.ref() is p else None


def register(params):
    """Give the parameters (leaf tensors requiring grad) pooled gradient storage. Returns the new FlatBuffers."""
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
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += (p.numel() + align - 1) // align * align
        xp = backend.xp_for(dev)
        with dev.context():
            flat_arr = xp.zeros(total, dtype=dt.np)
        buf = FlatBuffer(_wrap(flat_arr), [])
        for p, off in zip(ps, offsets):
            s = _Slot()
            s.buffer, s.offset, s.numel = buf, off, p.numel()
            s.view = _wrap(flat_arr[off:off + s.numel].reshape(p._data.shape))
            if p._grad is not None:  # keep an existing gradient's values
                s.view._data[...] = p._grad._data
                p._grad = s.view
            key = id(p)
            s.ref = weakref.ref(p, lambda r, key=key: _drop(r, key))
            _slots[key] = s
            buf.slots.append(s)
        _buffers.add(buf)
        made.append(buf)
    if made:
        engine.leaf_grad_sink = _sink
    return made


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
    view = s.view
    cur = leaf._grad
    gd = g._data
    if gd.shape != view._data.shape:
        return False
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
    if whole:
        _memset(buf.tensor._data)
    else:
        for s in slots:
            _memset(s.view._data)
    for s in slots:
        s.view._version[0] += 1
        if set_to_none:
            s.ref()._grad = None


def _require(param):
    s = _slot_of(param)
    if s is None:
        raise AutogradError(f"parameter of shape {fmt_shape(param.shape)}, dtype {param.dtype}, device {param.device} "
                         f"is not registered in the gradient pool; call flame_core.grad_pool.register(params) first")
    return s


def flat_buffer_of(param):
    """The 1-D Tensor that holds `param`'s gradient (shared storage; for fused optimizers and all-reduce)."""
    return _require(param).buffer.tensor


def pooled_grad(param):
    """The view of `flat_buffer_of(param)` that backward stores `param`'s gradient in: `param.grad` is this very
    Tensor while the gradient is pooled (all-reduce checks that, and makes it `.grad` where this rank produced no
    gradient but the reduced buffer holds one)."""
    return _require(param).view


def slice_of(param):
    """(offset, numel) of `param`'s gradient inside `flat_buffer_of(param)`, in elements."""
    s = _require(param)
    return s.offset, s.numel


def buffers():
    """Every live FlatBuffer."""
    return list(_buffers)
