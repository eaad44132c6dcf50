"""CUDA-specific helpers with PyTorch's names: `flame_core.cuda.CUDAGraph`, `flame_core.cuda.graph`,
`flame_core.cuda.graphed` (a function replayed as a CUDA graph), `is_available`, `synchronize`, `mem_get_info`."""
from .. import backend as _backend
from .graphs import CUDAGraph, GraphedFunction, graph, graphed, is_capturing


def is_available():
    return _backend.cuda_available()


def synchronize():
    """Wait for all work on the current device (no-op without a GPU)."""
    if _backend.cuda_available():
        _backend.cupy.cuda.Device().synchronize()


def mem_get_info(device=None):
    """(free, total) bytes of a GPU as the driver reports them (torch.cuda.mem_get_info): FLAME's pool, the CUDA
    context, libraries' code and workspaces and other processes all count as used. device: 'cuda:N' or an index
    (default: the current GPU)."""
    from ..device import device as _device
    from ..errors import DeviceError
    if not _backend.cuda_available():
        raise DeviceError("mem_get_info: no CUDA GPU is available here")
    if device is None:
        index = _backend.cupy.cuda.Device().id
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        dev = _device(device)
        if dev.type != "cuda":
            raise DeviceError(f"mem_get_info: {dev} is not a GPU")
        index = dev.index
    with _backend.cupy.cuda.Device(index):
        return _backend.cupy.cuda.runtime.memGetInfo()


__all__ = ["CUDAGraph", "graph", "graphed", "GraphedFunction", "is_capturing", "is_available", "synchronize",
           "mem_get_info"]
