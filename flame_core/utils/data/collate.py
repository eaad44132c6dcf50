"""default_collate / default_convert with PyTorch's rules, producing flame_core Tensors.

default_collate(batch), by the type of batch[0]:
    Tensor -> stack (a new dim 0)          NumPy array -> stacked cpu Tensor (string/object arrays refused)
    NumPy scalar -> cpu Tensor             float -> float64 Tensor; int -> int64 (bool -> bool) Tensor
    str / bytes -> the list unchanged      Mapping -> same keys, each collated
    namedtuple -> same type, fields collated
    other sequence -> each position collated (a tuple gives a list, as in PyTorch; a list keeps its type)
NumPy data becomes cpu tensors (move batches with .to(device), or pin them with the DataLoader's pin_memory).
`collate(batch, collate_fn_map=...)` takes the per-type functions, as PyTorch's `collate`.
"""
import collections.abc
import copy
import re

import numpy as np

from ...tensor import Tensor

_STR_OBJ = re.compile(r"[SaUO]")
_ERR = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}")


def _cpu_tensor(arr):
    from ...ops.creation import as_tensor
    return as_tensor(np.ascontiguousarray(arr), device="cpu")


def collate_tensor_fn(batch, *, collate_fn_map=None):
    from ...ops.shape import stack
    return stack(list(batch), 0)


def collate_numpy_array_fn(batch, *, collate_fn_map=None):
    if _STR_OBJ.search(batch[0].dtype.str) is not None:
        raise TypeError(_ERR.format(batch[0].dtype))
    return collate([_cpu_tensor(b) for b in batch], collate_fn_map=collate_fn_map)


def collate_numpy_scalar_fn(batch, *, collate_fn_map=None):
    return _cpu_tensor(np.asarray(batch))


def collate_float_fn(batch, *, collate_fn_map=None):
    return _cpu_tensor(np.asarray(batch, dtype=np.float64))


def collate_int_fn(batch, *, collate_fn_map=None):
    if all(isinstance(b, bool) for b in batch):
        return _cpu_tensor(np.asarray(batch, dtype=np.bool_))
    return _cpu_tensor(np.asarray(batch, dtype=np.int64))


def collate_str_fn(batch, *, collate_fn_map=None):
    return batch


default_collate_fn_map = {
    Tensor: collate_tensor_fn,
    np.ndarray: collate_numpy_array_fn,
    (np.bool_, np.number, np.object_): collate_numpy_scalar_fn,
    float: collate_float_fn,
    int: collate_int_fn,
    str: collate_str_fn,
    bytes: collate_str_fn,
}


def rebuild_mapping(like, fields):
    """The dict `fields` as a mapping of like's type (a copy of a mutable `like`, updated), as PyTorch rebuilds
    containers; the dict itself when that type cannot be built from one."""
    try:
        if isinstance(like, collections.abc.MutableMapping):
            out = copy.copy(like)
            out.update(fields)
            return out
        return type(like)(fields)
    except TypeError:
        return fields


def rebuild_sequence(like, items):
    """The list `items` as a sequence of like's type (a copy of a mutable `like` with its items replaced); the list
    itself when that type cannot be built from one."""
    try:
        if isinstance(like, collections.abc.MutableSequence):
            out = copy.copy(like)
            for i, item in enumerate(items):
                out[i] = item
            return out
        return type(like)(items)
    except TypeError:
        return items


def collate(batch, *, collate_fn_map=None):
    """Collate a list of samples; containers recurse, leaves go to the function `collate_fn_map` gives their type."""
    elem = batch[0]
    elem_type = type(elem)
    if collate_fn_map is not None:
        if elem_type in collate_fn_map:
            return collate_fn_map[elem_type](batch, collate_fn_map=collate_fn_map)
        for kind, fn in collate_fn_map.items():
            if isinstance(elem, kind):
                return fn(batch, collate_fn_map=collate_fn_map)
    if isinstance(elem, collections.abc.Mapping):
        return rebuild_mapping(elem, {key: collate([d[key] for d in batch], collate_fn_map=collate_fn_map)
                                      for key in elem})
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return elem_type(*(collate(list(s), collate_fn_map=collate_fn_map) for s in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        size = len(elem)
        if any(len(e) != size for e in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        columns = [collate(list(s), collate_fn_map=collate_fn_map) for s in zip(*batch)]
        return columns if isinstance(elem, tuple) else rebuild_sequence(elem, columns)
    raise TypeError(_ERR.format(elem_type))


def default_collate(batch):
    """Stack a list of samples into a batch (see the module docstring for the rules)."""
    return collate(batch, collate_fn_map=default_collate_fn_map)


def default_convert(data):
    """NumPy arrays and scalars inside `data` become cpu Tensors; everything else is kept (the DataLoader's collate
    function when automatic batching is off, batch_size=None)."""
    if isinstance(data, Tensor):
        return data
    t = type(data)
    if t.__module__ == "numpy" and t.__name__ not in ("str_", "bytes_", "string_"):
        if isinstance(data, np.ndarray) and _STR_OBJ.search(data.dtype.str) is not None:
            return data
        return _cpu_tensor(np.asarray(data))
    if isinstance(data, collections.abc.Mapping):
        return rebuild_mapping(data, {key: default_convert(data[key]) for key in data})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return t(*(default_convert(d) for d in data))
    if isinstance(data, tuple):
        return [default_convert(d) for d in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        return rebuild_sequence(data, [default_convert(d) for d in data])
    return data
