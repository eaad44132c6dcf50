"""Where a streamed block's weights live between uses: one contiguous pinned host buffer per block (or views of a
memory-mapped safetensors file), and the layout that maps each tensor to a byte range of it and of a GPU slot.

A block's tensors (its frozen parameters and its buffers; trainable parameters too for layer-wise fine-tuning) are
laid out back to back at 256-byte aligned offsets. Copying the block to the GPU is then ONE host->device copy of the
pinned buffer into a slot, and each tensor's array becomes a view of the slot (`bind`). While the block is not on the
GPU its tensors hold a placeholder: a read-only, stride-0 view of one NaN, with the right shape and dtype and no
memory, so a block used outside the streamer gives NaN rather than another block's weights.
"""
import json
import os

import numpy as np

from flame_core import backend
from flame_core import dtypes as D
from flame_core.errors import FlameError
from flame_core.memory import pinned_pool

ALIGN = 256


class OffloadError(FlameError, ValueError):
    """A block cannot be streamed as asked (the message names the block and tensor)."""


class Entry:
    """One tensor of a block: where its bytes sit in the block layout, and what array type it has on the device."""
    __slots__ = ("name", "tensor", "offset", "nbytes", "shape", "dtype", "trainable", "empty")

    def __init__(self, name, tensor, dtype):
        self.name, self.tensor = name, tensor
        self.shape = tuple(tensor.array.shape)
        self.dtype = np.dtype(dtype)  # the array dtype on the device (uint8 for cuda fp8 bytes)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.trainable = bool(tensor.requires_grad)
        self.offset = 0
        self.empty = None  # its placeholder, made once


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------- placeholders
_cells = {}


def placeholder(shape, dtype, device):
    """A read-only stride-0 array of `shape` whose one element is NaN (0 for integer dtypes, the NaN byte 0x7F for
    fp8 bytes): shape and dtype without memory."""
    key = (str(device), np.dtype(dtype).str, np.dtype(dtype).name)
    cell = _cells.get(key)
    if cell is None:
        dt = np.dtype(dtype)
        if dt == np.uint8:
            host = np.array(0x7F, dtype=np.uint8)
        elif dt.kind == "f" or dt in (D.bfloat16.np, D.float8_e4m3fn.np):
            host = np.array(np.nan, dtype=np.float32).astype(dt)
        else:
            host = np.zeros((), dt)
        if device.type == "cuda":
            with device.context():
                cell = backend.cupy.asarray(host)
        else:
            cell = host
        _cells[key] = cell
    xp = backend.xp_of(cell)
    arr = xp.broadcast_to(cell, tuple(shape))
    if xp is np:
        arr.flags.writeable = False
    return arr


# ----------------------------------------------------------------------------- the host copy of a block
class HostBlock:
    """The layout and host storage of one block.

    entries       every streamed tensor, in layout order
    nbytes        bytes of the layout (the slot size it needs)
    host          the pinned uint8 buffer holding entries [0, pinned_bytes) (None when everything is mapped)
    segments      [(host uint8 array, offset in the layout)]: what a load copies (one for the pinned part, one per
                  memory-mapped tensor)
    """

    def __init__(self, index, block, device, stream_trainable=False, sources=None, prefix=""):
        self.index = index
        self.device = device
        tensors = []
        for name, p in block.named_parameters():
            if p.requires_grad and not stream_trainable:
                continue  # trainable parameters (LoRA's live outside the block anyway) stay on the GPU
            tensors.append((name, p))
        for name, b in block.named_buffers():
            tensors.append((name, b))
        if not tensors:
            raise OffloadError(f"block {index} ({type(block).__name__}) has no frozen parameters or buffers to stream: "
                               f"trainable parameters stay on the GPU, so freeze the base first "
                               f"(model.requires_grad_(False); adapters keep training), or pass "
                               f"stream_trainable=True for layer-wise fine-tuning (LayerwiseAdamW)")
        mapped, pinned = [], []
        for name, t in tensors:
            src = None if sources is None else sources.get(prefix + name)
            if src is not None:
                want = t.array.dtype if not t._f8 else D.float8_e4m3fn.np
                if tuple(src.shape) != tuple(t.shape) or np.dtype(src.dtype) != np.dtype(want):
                    raise OffloadError(f"block {index}: {prefix + name} is {np.dtype(src.dtype).name} "
                                       f"{tuple(src.shape)} in the mapped file but {np.dtype(want).name} "
                                       f"{tuple(t.shape)} in the model; memory-mapped weights stream as stored "
                                       f"(load them instead, or build the model in the file's dtype)")
                mapped.append((Entry(name, t, np.uint8 if t._f8 else t.array.dtype), src))
            else:
                if getattr(t, "_meta_device", None) is not None:
                    raise OffloadError(f"block {index}: {prefix + name} was created under empty_init and has no "
                                       f"data: load the block's weights before streaming it (or pass sources=)")
                pinned.append(Entry(name, t, t.array.dtype))
        off = 0
        for e in pinned:
            e.offset = off
            off += _aligned(e.nbytes)
        self.pinned_bytes = off
        for e, _ in mapped:
            e.offset = off
            off += _aligned(e.nbytes)
        self.mapped_bytes = sum(e.nbytes for e, _ in mapped)   # read from memory-mapped files (page cache)
        self.nbytes = max(off, ALIGN)
        self.entries = pinned + [e for e, _ in mapped]
        self.host = None
        self.segments = []
        if pinned:
            self.host = pinned_pool().empty((self.pinned_bytes,), np.uint8)
            for e in pinned:
                arr = e.tensor.array
                if backend.is_cuda_array(arr):
                    arr = backend.cupy.ascontiguousarray(arr)
                self.host[e.offset:e.offset + e.nbytes] = backend.to_numpy(arr).reshape(-1).view(np.uint8)
            self.segments.append((self.host, 0))
        for e, src in mapped:
            self.segments.append((np.ascontiguousarray(src).reshape(-1).view(np.uint8), e.offset))
        self.bound = None  # the device uint8 array the tensors are views of (a slot or own storage), or None
        self.written = None  # write-back event of a layer-wise update writing the host copy (BlockStreamer)

    @property
    def trainable(self):
        return [e for e in self.entries if e.trainable]

    def load(self, engine, dst):
        """Enqueue the copy of the block into device buffer `dst` (uint8) on the copy stream."""
        for src, off in self.segments:
            engine.h2d(dst, off, src)

    def bind(self, dst, views=None):
        """Make every tensor a view of device buffer `dst`; `views` caches the arrays per buffer."""
        arrays = None if views is None else views.get(id(dst))
        if arrays is None:
            arrays = [dst[e.offset:e.offset + e.nbytes].view(e.dtype).reshape(e.shape) for e in self.entries]
            if views is not None:
                views[id(dst)] = arrays
        for e, a in zip(self.entries, arrays):
            t = e.tensor
            t.set_array_(a)
            t._version[0] += 1  # new contents: nothing may use a cast or a saved view of the old ones
            if getattr(t, "_meta_device", None) is not None:
                t._meta_device = None
        self.bound = dst

    def bind_host(self):
        """Make every tensor a view of its host copy (NumPy: writable where pinned, read-only where memory-mapped),
        for reading or writing the weights as cpu tensors while the block is not on the device."""
        mapped = {off: src for src, off in self.segments if src is not self.host}
        for e in self.entries:
            if e.tensor._f8:
                raise OffloadError(f"block {self.index}: {e.name} is stored as fp8 bytes, which no cpu tensor views")
            raw = self.host[e.offset:e.offset + e.nbytes] if e.offset < self.pinned_bytes else mapped[e.offset]
            e.tensor.set_array_(raw.view(e.dtype).reshape(e.shape))
            e.tensor._version[0] += 1
        self.bound = None

    def unbind(self):
        for e in self.entries:
            if e.empty is None:
                e.empty = placeholder(e.shape, e.dtype, self.device)
            e.tensor.set_array_(e.empty)
            e.tensor._version[0] += 1
            if getattr(e.tensor, "_meta_device", None) is not None:
                e.tensor._meta_device = None  # the streamer gives it data now (a file-mapped source)
        self.bound = None

    def host_arrays(self):
        """{name: host NumPy array} of the block's tensors (views of the pinned buffer or of the mapped file)."""
        out = {}
        mapped = {off: src for src, off in self.segments if src is not self.host}
        for e in self.entries:
            dt = D.float8_e4m3fn.np if (e.dtype == np.uint8 and e.tensor._f8) else e.dtype
            if e.offset < self.pinned_bytes:
                raw = self.host[e.offset:e.offset + e.nbytes]
            else:
                raw = mapped[e.offset]
            out[e.name] = raw.view(dt).reshape(e.shape)
        return out


# ----------------------------------------------------------------------------- memory-mapped safetensors
def safetensors_views(files, key_map=None):
    """{module key: read-only NumPy view of that tensor inside the memory-mapped file(s)}: nothing is read until a
    block is copied to the GPU (pages come from the OS page cache; pageable, so slower than pinned). For inference:
    pass it as `BlockStreamer(..., sources=...)`. `key_map(file_key) -> module key or None` renames or skips keys."""
    from flame_core.io import safe_open
    files = [files] if isinstance(files, (str, bytes)) or hasattr(files, "__fspath__") else list(files)
    out = {}
    for path in files:
        path = os.fspath(path)
        with safe_open(path) as h:  # validates the header; gives the dtypes
            keys = h.keys()
            dtypes = {k: h.dtype(k) for k in keys}
            shapes = {k: tuple(h.shape(k)) for k in keys}
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n).decode("utf-8"))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        start = 8 + n
        for k in keys:
            mk = key_map(k) if key_map is not None else k
            if mk is None:
                continue
            b, e = header[k]["data_offsets"]
            out[mk] = mm[start + b:start + e].view(dtypes[k]).reshape(shapes[k])
    return out
