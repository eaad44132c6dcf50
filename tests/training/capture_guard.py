"""What a CUDA graph capture cannot contain, caught on the CPU.

A capture (flame_core.cuda.graphed; the trainer's cuda_graph) fails when the captured region reads device values on
the host, copies host data to the device, draws random numbers, or concatenates more than 8 arrays in one call (CuPy
does that with a kernel that reads the arrays' addresses from a table it copies from host memory at every call; the
copy's event is queried inside the capture). The trainer then trains eagerly and says so only when verbose, so the
GPU suite sees no error, just no graph. `no_host_sync()` turns each of those into a HostSyncError with the stack of
the op, on the CPU. It cannot see what happens only to CUDA arrays (CuPy's own cuBLAS wrappers, which refuse to run
while capturing: tests/core/test_cuda_graphs.py captures those paths on the GPU).

    with no_host_sync():
        out = fn(*args)
    guarded_step(trainer)     # one training step whose captured region (_forward_backward) runs under the guard
"""
import contextlib

import numpy as np

import flame_core as flame
from flame_core import backend
from flame_core.ops import creation
from flame_core.random import Generator
from flame_core.tensor import Tensor

CUPY_SINGLE_KERNEL_CONCAT = 8  # CuPy's _concatenate: more arrays than this take the kernel with the host table


class HostSyncError(AssertionError):
    """An operation inside a guarded (to be captured) region that a CUDA graph capture refuses."""


def _refuse(what):
    def fn(*args, **kwargs):
        raise HostSyncError(f"inside a region a CUDA graph captures: {what}")
    return fn


def _host_data(data):
    return not isinstance(data, Tensor) and not backend.is_cuda_array(data) and np.ndim(data) > 0


def _guard_creation(name, fn):
    def guarded(data, *args, **kwargs):
        if _host_data(data):
            raise HostSyncError(f"inside a region a CUDA graph captures: {name}() copies host data to the device "
                                f"(make it before the captured region, e.g. once at the first call)")
        return fn(data, *args, **kwargs)
    return guarded


def _guard_concat(name, fn):
    def guarded(arrays, *args, **kwargs):
        arrays = list(arrays)
        if len(arrays) > CUPY_SINGLE_KERNEL_CONCAT:
            raise HostSyncError(f"inside a region a CUDA graph captures: {name} of {len(arrays)} arrays (CuPy joins "
                                f"more than {CUPY_SINGLE_KERNEL_CONCAT} through an address table copied from the host; "
                                f"a split into that many pieces does it in backward)")
        return fn(arrays, *args, **kwargs)
    return guarded


@contextlib.contextmanager
def no_host_sync():
    """Within: host reads of tensor values, host data turned into tensors, random draws and concatenations of more
    than 8 arrays raise HostSyncError. Everything is restored on exit."""
    patches = [(Tensor, "_host", _refuse("a tensor's values are read on the host (.item(), .numpy(), .tolist(), "
                                         "float(t), int(t), bool(t) / `if t`, printing)")),
               (backend, "to_numpy", _refuse("an array is copied to the host (backend.to_numpy)"))]
    for name in ("_normal", "_uniform", "_integers"):
        patches.append((Generator, name, _refuse("random numbers are drawn (they would repeat on every replay)")))
    for name in ("tensor", "as_tensor", "from_numpy"):
        fn = getattr(creation, name)
        guarded = _guard_creation(name, fn)
        patches.append((creation, name, guarded))
        if getattr(flame, name, None) is fn:
            patches.append((flame, name, guarded))
    for name in ("concatenate", "stack"):
        patches.append((np, name, _guard_concat(f"np.{name}", getattr(np, name))))
    saved = [(obj, name, obj.__dict__[name] if name in vars(obj) else getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


def guarded_step(trainer, warmup=2):
    """`warmup` eager training steps (as GraphedFunction runs before it captures: lazily made tables, caches and
    optimizer state come from them), then one step whose captured region -- Trainer._forward_backward -- runs
    under no_host_sync(). Returns that step's (loss, lr, mean timestep)."""
    for _ in range(warmup):
        trainer.train_step()
    fn = trainer._forward_backward

    def captured(*args):
        with no_host_sync():
            return fn(*args)
    trainer._forward_backward = captured
    try:
        return trainer.train_step()
    finally:
        del trainer._forward_backward
