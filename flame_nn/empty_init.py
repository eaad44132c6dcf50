"""Build big models without allocating or initialising weights, then load them straight from safetensors files.

    with flame_nn.empty_init(device="cuda", dtype=flame.bfloat16):
        model = Flux(config)                 # parameters are meta placeholders: no memory, no random init
    flame_nn.load_weights_(model, ["a.safetensors", "b.safetensors"])   # one tensor at a time -> device/dtype
"""
import contextlib
import threading

from flame_core import dtypes as D
from flame_core.device import device as _parse_device

from .parameter import Parameter

_local = threading.local()


def _state():
    return getattr(_local, "ctx", None)


@contextlib.contextmanager
def empty_init(device=None, dtype=None):
    """Inside this block new parameters are meta placeholders (shape + dtype + target device, no array).

    `device`/`dtype` override what layers ask for (the dtype only for floating parameters). Buffers (small: running
    stats, frequency tables) are still allocated, as accelerate's `init_empty_weights` does by default.
    """
    prev = _state()
    _local.ctx = (None if device is None else _parse_device(device), None if dtype is None else D.dtype(dtype))
    try:
        yield
    finally:
        _local.ctx = prev


init_empty_weights = empty_init  # the name accelerate users know


def is_empty_init():
    return _state() is not None


def _target(dtype, device):
    ctx = _state()
    dt = D.dtype(dtype) if dtype is not None else D.get_default_dtype()
    dev = _parse_device(device)
    if ctx is not None:
        if ctx[0] is not None:
            dev = ctx[0]
        if ctx[1] is not None and dt.is_floating_point:
            dt = ctx[1]
    return dt, dev


def new_parameter(shape, dtype=None, device=None, requires_grad=True):
    """What layers call for their weights: an uninitialised Parameter, or a meta one under `empty_init`."""
    dt, dev = _target(dtype, device)
    if _state() is not None:
        return Parameter.meta(shape, dt, dev, requires_grad=requires_grad)
    from flame_core.ops.creation import empty
    return Parameter(empty(tuple(shape), dtype=dt, device=dev), requires_grad=requires_grad)


def to_meta_if_empty_init(p):
    """Called when a module registers a Parameter: under `empty_init` it becomes a placeholder (its data dropped)."""
    ctx = _state()
    if ctx is None or p is None or p.is_meta:
        return p
    dev = ctx[0] if ctx[0] is not None else p.device
    dt = ctx[1] if (ctx[1] is not None and p.dtype.is_floating_point) else p.dtype
    return Parameter.meta(tuple(p.shape), dt, dev, requires_grad=p.requires_grad)


def load_weights_(module, files, *, strict=True, device=None, dtype=None, key_map=None):
    """Load safetensors file(s) into `module`, reading one tensor at a time and converting it on load.

    Meta parameters are materialised on their target device and dtype (or `device`/`dtype` when given); existing
    parameters are overwritten in place. `key_map(file_key) -> module_key or None` renames or skips file keys.
    Returns `(missing_keys, unexpected_keys)`; with `strict=True` raises listing missing, unexpected and misshaped keys.
    """
    from flame_core.io import safe_open

    from .module import StateDictError, _format_load_errors
    files = [files] if isinstance(files, (str, bytes)) or hasattr(files, "__fspath__") else list(files)
    expected = dict(module._state_items())
    dt_over = D.dtype(dtype) if dtype is not None else None
    dev_over = _parse_device(device) if device is not None else None

    plan, unexpected = [], []   # plan: (file index, file key, module key)
    handles = [safe_open(f) for f in files]
    try:
        seen = {}
        for fi, h in enumerate(handles):
            for k in h.keys():
                mk = key_map(k) if key_map is not None else k
                if mk is None:
                    continue
                if mk in seen:
                    raise StateDictError(f"key {mk!r} appears twice: in {files[seen[mk]]} and {files[fi]}")
                seen[mk] = fi
                if mk in expected:
                    plan.append((fi, k, mk))
                else:
                    unexpected.append(mk)
        missing = [k for k in expected if k not in seen]
        misshaped = []
        for fi, k, mk in plan:
            fshape = tuple(handles[fi].shape(k))
            if fshape != tuple(expected[mk].shape):
                misshaped.append((mk, fshape, tuple(expected[mk].shape)))
        if misshaped or (strict and (missing or unexpected)):
            raise StateDictError(_format_load_errors(type(module).__name__, missing if strict else [],
                                                     unexpected if strict else [], misshaped,
                                                     source=", ".join(str(f) for f in files)))
        for fi, k, mk in plan:
            t = expected[mk]
            dev = dev_over or t.device
            dt = dt_over if (dt_over is not None and t.dtype.is_floating_point) else t.dtype
            _assign(t, *handles[fi].read(k, dtype=dt, device=dev))
    finally:
        for h in handles:
            h.close()
    return missing, unexpected


def _assign(t, arr, f8=False):
    """Put `arr` (already converted) into tensor `t`: new storage for placeholders / dtype changes, else in place."""
    from flame_core import backend
    if getattr(t, "_meta_device", None) is not None or arr.dtype != t.array.dtype or f8 != t._f8 or \
            backend.is_cuda_array(arr) != backend.is_cuda_array(t.array):
        if isinstance(t, Parameter):
            t.materialize_(arr, f8)
        else:
            t.set_array_(arr, f8)
            t._version[0] += 1
    else:
        t.array[...] = arr
        t._version[0] += 1
