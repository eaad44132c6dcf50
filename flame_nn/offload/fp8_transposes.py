"""Resident W^T for fp8-compute Linears: the input gradient's fp8 GEMM (dX = dY @ W) takes the weight K-major, i.e.
W's e4m3 bytes transposed to (in, out). By default every backward call writes that transpose into the per-device
scratch buffer (fp8.transposed_into_scratch): 1 byte per weight and per call, at copy bandwidth already (4.07 ms of
an SD3.5-Large step, ~10 ms of Qwen-Image on an H200). Keeping it instead costs the fp8 weights' size again in GPU
memory (TransformerEngine keeps it for frozen weights too), so it is opt-in:

    cache_fp8_transposes_(model)           # bytes held; every resident fp8-compute Linear's W^T made once, now
    cache_fp8_transposes_(model, False)    # dropped (memory freed)

The transpose is made eagerly at that call, never inside a backward (a CUDA graph capture may be running there).
Each cache remembers the array it was made from (the array object, its version counter); the backward uses it only
while the weight's array is still that one, else it transposes into the scratch as before: a replaced or
re-quantised weight, or a block the streamer rebinds, falls back by itself. Blocks a BlockStreamer streams are
skipped (their arrays are slot views that change per step: caching them would hold every streamed weight on the
GPU, the memory streaming exists to save); a block it keeps resident is cached.
"""
import weakref

from flame_core import as_tensor, backend
from flame_core.autograd import no_grad

from .fp8 import Float8LinearMixin
from .host import OffloadError

_KEY = "_fp8_wt"   # a Linear's TransposedWeight, in its __dict__ (not a buffer: it is not state to save)


def _array_ref(arr):
    """A weak reference to `arr` where its type takes one, else a (id, address) pair (identity without keeping the
    array alive: a stale cache must not hold the old weight's memory)."""
    try:
        return weakref.ref(arr)
    except TypeError:
        ptr = arr.data.ptr if backend.is_cuda_array(arr) else arr.__array_interface__["data"][0]
        return id(arr), ptr


class TransposedWeight:
    """W^T of one fp8 weight tensor (q: (out, in) e4m3) as the backward's GEMM reads it: (in, out), C-contiguous,
    of q's array dtype (uint8 bytes on cuda, float8 on the cpu), the same bits transposed_into_scratch writes."""

    def __init__(self, q):
        from flame_core.kernels import fp8_tensor as _KT
        arr = q.array
        if backend.is_cuda_array(arr):
            with backend.cupy.cuda.Device(arr.device.id):   # allocated on the weight's device
                wt = _KT.transpose_fp8(arr)
        else:
            wt = _KT.transpose_fp8(arr)
        self.tensor = as_tensor(wt)   # a Tensor: the memory accounting counts it
        self._src = _array_ref(arr)
        self._version = (q._version, q._version[0])

    @property
    def array(self):
        return self.tensor.array

    @property
    def nbytes(self):
        return int(self.array.nbytes)

    def holds(self, q):
        """True while q (the weight Tensor) still has the array this transpose was made from, unmodified."""
        box, v = self._version
        if q._version is not box or box[0] != v:
            return False
        arr, src = q.array, self._src
        if isinstance(src, weakref.ref):
            return src() is arr
        ptr = arr.data.ptr if backend.is_cuda_array(arr) else arr.__array_interface__["data"][0]
        return src == (id(arr), ptr)


def weight_transposed(q, cache):
    """q's (in, out) transpose for dX = dY @ W: the layer's cached one while it holds q's array, else written into
    the scratch buffer (a view valid until the next call on that device)."""
    if cache is not None and cache.holds(q):
        return cache.array
    from . import fp8
    return fp8.transposed_into_scratch(q.array)


def streamed_modules(module):
    """ids of the modules inside `module` whose weights a BlockStreamer streams (blocks not resident), from the
    streamer hook on their stacks."""
    from .streamer import _ATTR
    out = set()
    for m in module.modules():
        hook = m.__dict__.get(_ATTR)
        if hook is None:
            continue
        streamer, offset = hook
        resident = set(streamer.resident)
        for j, block in enumerate(m):
            if offset + j not in resident:
                out.update(id(b) for b in block.modules())
    return out


def cached_transposes(module):
    """{name: TransposedWeight} of the fp8 Linears in `module` holding one."""
    return {n: m.__dict__[_KEY] for n, m in module.named_modules() if m.__dict__.get(_KEY) is not None}


def cache_fp8_transposes_(module, enabled=True):
    """Keep W^T of every fp8-compute Linear in `module` (itself included) resident on its device, for the input
    gradient's fp8 GEMM (see the module docstring): made now, once per weight (a cache still valid is kept), except
    for blocks a BlockStreamer streams (their caches are dropped: pass the model or its block stacks, where the
    streamer's hook is). enabled=False drops every cache. Not inside a CUDA graph capture. Returns the bytes the
    caches hold afterwards."""
    from flame_core.cuda.graphs import is_capturing
    if is_capturing():
        raise OffloadError("cache_fp8_transposes_ inside a CUDA graph capture: call it before capturing")
    streamed = streamed_modules(module) if enabled else set()
    held = 0
    with no_grad():
        for name, m in module.named_modules():
            if not isinstance(m, Float8LinearMixin):
                continue
            d = m.__dict__
            if not (enabled and m.fp8_compute) or id(m) in streamed:
                d.pop(_KEY, None)
                continue
            if m.weight.is_meta:
                raise OffloadError(f"cache_fp8_transposes_: {name or type(m).__name__}.weight has no data yet "
                                   f"(empty_init): load the weights first")
            cache = d.get(_KEY)
            if cache is None or not cache.holds(m.weight):
                d[_KEY] = None                   # the old one freed before the new one is made
                cache = d[_KEY] = TransposedWeight(m.weight)
            held += cache.nbytes
    return held

