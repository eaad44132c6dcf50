"""FLAME's DevicePool installed as CuPy's allocator: one pool per GPU, raw memory from cudaMalloc.

`install()` wraps the pools in `cupy.cuda.memory.PythonFunctionAllocator` and hands its `malloc` to
`cupy.cuda.set_allocator`: every CuPy allocation (arrays, reduction scratch, cuBLAS/cuFFT buffers that go
through CuPy) then comes from the pool; CuPy calls the free function when the last array over a block dies.
`flame_core.memory` installs it on import when CuPy sees a GPU, unless FLAME_CUDA_POOL=0.
"""
from .. import backend as _backend
from . import cpu_tracking, tracking
from .pool import DeviceOutOfMemory, DevicePool

pools = {}  # device id -> DevicePool
_allocator = None


class CudaBackend:
    """Raw device memory for a DevicePool: cudaMalloc / cudaFree, keyed by the current CuPy stream."""

    def __init__(self, device_id):
        cp = _backend.cupy
        self.device_id = device_id
        self._cp = cp
        self._rt = cp.cuda.runtime
        self._current_stream = cp.cuda.get_current_stream

    def malloc(self, nbytes):
        try:
            with self._cp.cuda.Device(self.device_id):
                return self._rt.malloc(nbytes)
        except self._rt.CUDARuntimeError as e:
            if getattr(e, "status", None) == 2:  # cudaErrorMemoryAllocation
                raise DeviceOutOfMemory(str(e)) from None
            raise

    def free(self, ptr, nbytes):
        with self._cp.cuda.Device(self.device_id):
            self._rt.free(ptr)

    def stream_key(self):
        return self._current_stream().ptr

    def mem_info(self):
        with self._cp.cuda.Device(self.device_id):
            return self._rt.memGetInfo()

    def release_foreign(self):
        """Blocks cached by CuPy's own pool (arrays made before FLAME's pool was installed)."""
        self._cp.get_default_memory_pool().free_all_blocks()


def pool_for(device_id):
    pool = pools.get(device_id)
    if pool is None:
        pool = pools[device_id] = DevicePool(CudaBackend(device_id), name=f"cuda:{device_id}")
    return pool


def _malloc(nbytes, device_id):
    pool = pools.get(device_id)
    if pool is None:
        pool = pool_for(device_id)
    return pool.malloc(nbytes)


def _free(ptr, device_id):
    try:
        pools[device_id].free(ptr)
    except Exception:  # interpreter shutdown: module globals may already be gone
        pass


def _birth(arr):
    """Tag the block a new cuda tensor lives on with its shape and dtype (and origin when tracking)."""
    mp = arr.data
    pool = pools.get(mp.device_id)
    if pool is None:
        return
    blk = pool._live.get(mp.mem.ptr)
    if blk is not None and blk.tag is None:
        blk.tag = (arr.shape, arr.dtype, tracking.origin() if tracking._enabled else None)
        if pool.observer is not None:
            pool.observer("tag", pool, blk)


def install():
    """Make FLAME's pools CuPy's allocator (idempotent)."""
    global _allocator
    cp = _backend.cupy
    if _allocator is None:
        _allocator = cp.cuda.memory.PythonFunctionAllocator(_malloc, _free)
    cp.cuda.set_allocator(_allocator.malloc)
    cpu_tracking.set_cuda_birth(_birth)


def uninstall():
    """Give allocation back to CuPy's default pool (blocks already handed out still return to FLAME's)."""
    cp = _backend.cupy
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    cpu_tracking.set_cuda_birth(None)


def is_installed():
    return _allocator is not None and cpu_tracking.cuda_birth is _birth
