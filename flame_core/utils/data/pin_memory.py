"""pin_memory(data): every cpu Tensor inside `data` copied into FLAME's pinned host pool (flame_core.memory), so
that a later `.to("cuda", non_blocking=True)` copies from page-locked memory. Containers are rebuilt as
default_collate builds them; objects with a `pin_memory()` method are asked to pin themselves; cuda tensors and
everything else pass through.
"""
import collections.abc

from ...tensor import Tensor
from .collate import rebuild_mapping, rebuild_sequence


def _pin_tensor(t):
    from ...memory import pinned_empty
    if t.is_cuda or t._f8:
        return t
    out = pinned_empty(tuple(t.shape), t.dtype)
    out._data[...] = t._data
    return out


def pin_memory(data):
    if isinstance(data, Tensor):
        return _pin_tensor(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        return rebuild_mapping(data, {k: pin_memory(v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(pin_memory(d) for d in data))
    if isinstance(data, tuple):
        return [pin_memory(d) for d in data]
    if isinstance(data, collections.abc.Sequence):
        return rebuild_sequence(data, [pin_memory(d) for d in data])
    if callable(getattr(data, "pin_memory", None)):
        return data.pin_memory()
    return data
