"""CUDA-specific helpers with PyTorch's names: `flame_core.cuda.CUDAGraph`, `flame_core.cuda.graph`,
`flame_core.cuda.graphed` (a function replayed as a CUDA graph), `is_available`, `synchronize`."""
from .. import backend as _backend
from .graphs import CUDAGraph, graph, graphed, GraphedFunction, is_capturing


def is_available():
    return _backend.cuda_available()


def synchronize():
    """Wait for all work on the current device (no-op without a GPU)."""
    if _backend.cuda_available():
        _backend.cupy.cuda.Device().synchronize()


__all__ = ["CUDAGraph", "graph", "graphed", "GraphedFunction", "is_capturing", "is_available", "synchronize"]
