"""CUDA-specific helpers with PyTorch's names: `flame_core.cuda.CUDAGraph`, `flame_core.cuda.graph`,
`flame_core.cuda.graphed` (a function replayed as a CUDA graph), `is_available`, `synchronize`, `mem_get_info`."""
from .. import backend as _backend
from .graphs import CUDAGraph, graph, graphed, GraphedFunction, is_capturing


def is_available():
    return _backend.cuda_available()


def synchronize():
    """Wait for all work on the current device (no-op without a GPU)."""
    if _backend.cuda_available():
        _backend.cupy.cuda.Device().synchronize()


def mem_get_info(device=None):
    """(free, total) bytes of the GPU as the driver sees them (cudaMemGetInfo: every process and allocator
    counts), as torch.cuda.mem_get_info. `device`: an index, 'cuda:N' or a device; default the current one."""
    if not _backend.cuda_available():
        raise RuntimeError("mem_get_info: no CUDA GPU is visible")
    cp = _backend.cupy
    if device is None:
        return cp.cuda.runtime.memGetInfo()
    from ..device import device as _device
    index = device if isinstance(device, int) else (_device(device).index or 0)
    with cp.cuda.Device(index):
        return cp.cuda.runtime.memGetInfo()


__all__ = ["CUDAGraph", "graph", "graphed", "GraphedFunction", "is_capturing", "is_available", "synchronize",
           "mem_get_info"]
