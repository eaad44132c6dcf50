"""Launching compiled kernels: plain launches, programmatic dependent launches (sm_90) and packed launches whose
arguments are converted once (hot paths with many fixed scalars).

``launch(kernel, grid, block, args, shared_mem=0, stream=None)``
    Launches; ints in ``grid``/``block`` become 1-tuples; dynamic shared memory over 48 KiB is opted into; a
    ``tma.TensorMap`` argument is passed by value (128 bytes: a ``__grid_constant__`` tensor map).
``launch_dependent(...)``, ``PackedLaunch(kernel, grid, block, args, n_pointers, ...)``
    See their docstrings.
``LaunchCache(limit)``
    Per-thread PackedLaunches (or whatever a wrapper keeps per call configuration), keyed by what fixes a kernel
    wrapper's grid and scalar arguments: the eager per-op path of a wrapper is a dict lookup, its arrays' addresses
    and one driver launch.
``f32(v)``, ``i32(v)``, ``i64(v)``, ``null()``, ``f32_bits(v)``
    Scalar kernel arguments of the C parameter types (``i32`` raises when the value does not fit).
``launches``
    How many kernels were launched (tests read it to prove a kernel path ran).
"""
import ctypes
import threading

import numpy as np

from .. import backend
from . import plans
from .loader import _ArchKernel
from .tma import TensorMap


def _dims(d):
    t = type(d)
    if t is int:
        return (d,)
    if t is tuple:
        for v in d:
            if type(v) is not int:
                break
        else:
            return d
    if isinstance(d, int):
        return (int(d),)
    return tuple(int(v) for v in d)


launches = 0  # how many kernels `launch` started (tests use it to prove a kernel path ran)


def allow_dynamic_smem(kernel, shared_mem):
    """int(shared_mem), after raising the kernel's dynamic shared memory limit where the launch needs more than 48 KiB
    with its static shared memory (a 48 KiB dynamic request beside any static array needs the raised limit too).
    `launch` calls it; code that launches otherwise (PackedLaunch) or asks the occupancy calculator calls it first."""
    shared_mem = int(shared_mem)
    if shared_mem + kernel.shared_size_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    return shared_mem


def _driver_function(kernel):
    """The cupy.cuda.function.Function (driver CUfunction at .ptr) of a RawKernel or an _ArchKernel."""
    return kernel._fn if isinstance(kernel, _ArchKernel) else kernel.kernel


def launch(kernel, grid, block, args, shared_mem=0, stream=None):
    """Launch `kernel` on `grid` x `block` with `args` (cupy arrays and numpy scalars of the C parameter types)."""
    global launches
    launches += 1
    grid, block = _dims(grid), _dims(block)
    if type(args) is not tuple:
        args = tuple(args)
    shared_mem = allow_dynamic_smem(kernel, shared_mem) if shared_mem else 0
    if any(type(a) is TensorMap for a in args):
        return _launch_by_value(kernel, grid, block, args, shared_mem, stream)
    if stream is not None:
        with stream:
            kernel(grid, block, args, shared_mem=shared_mem)
    else:
        kernel(grid, block, args, shared_mem=shared_mem)


def _launch_by_value(kernel, grid, block, args, shared_mem, stream):
    """A launch through the driver with our own parameter array: what CuPy's argument conversion has no type for
    (a TensorMap: 128 bytes or a struct of several maps, passed by value) is copied from its host address, the rest
    as `launch` passes it."""
    keep, ptrs = [], (ctypes.c_void_p * len(args))()
    for i, a in enumerate(args):
        if type(a) is TensorMap:
            ptrs[i] = a.address
            continue
        b = ctypes.create_string_buffer(
            int(a.data.ptr).to_bytes(8, "little") if backend.is_cuda_array(a) else np.asarray(a).tobytes())
        keep.append(b)
        ptrs[i] = ctypes.addressof(b)
    g, b = grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block))
    cuda = backend.cupy.cuda
    st = stream.ptr if stream is not None else cuda.get_current_stream().ptr
    cuda.driver.launchKernel(_driver_function(kernel).ptr, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, st,
                             ctypes.addressof(ptrs), 0)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute (cuda.h): id, padding to 8 bytes, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_ex = []  # [cuLaunchKernelEx of libcuda, or None where the driver has none]


def _cu_launch_ex():
    if not _launch_ex:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        except (OSError, AttributeError):
            fn = None
        _launch_ex.append(fn)
    return _launch_ex[0]


def launch_dependent(kernel, grid, block, args, shared_mem=0):
    """Launch `kernel` as a programmatic dependent of the kernel before it in the stream (sm_90; cuLaunchKernelEx with
    programmatic stream serialization): its blocks may start while that kernel still runs (from when every block of
    it has executed grid_dependents_launch), so the launch latency overlaps the earlier kernel's tail. The kernel
    must call grid_dependency_wait (common.cuh) before it reads the earlier kernel's output. Falls back to `launch`
    before sm_90, without cuLaunchKernelEx, and while a CUDA graph is being captured."""
    stream = backend.cupy.cuda.get_current_stream()
    if _cu_launch_ex() is None or plans.compute_capability() < 90 or (stream.ptr and stream.is_capturing()):
        return launch(kernel, grid, block, args, shared_mem)
    PackedLaunch(kernel, grid, block, args, (), allow_dynamic_smem(kernel, shared_mem), dependent=True)(())


def max_active_blocks(kernel, block_threads, shared_mem=0):
    """Blocks of `kernel` one SM holds at once with this block size and dynamic shared memory (the driver's
    occupancy calculator)."""
    return int(backend.cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        _driver_function(kernel).ptr, int(block_threads), int(shared_mem)))


class PackedLaunch:
    """A launch whose arguments are packed once: `__call__(pointers)` writes the pointer arguments that change from
    call to call (device addresses; the first `n_pointers` arguments, or those at the indices `n_pointers` lists)
    into the packed buffer and launches through the driver, skipping CuPy's per-argument conversion (about 0.5 us
    per argument). For hot paths with many fixed scalars; one per thread (the buffer is rewritten at each call).
    A TensorMap argument is passed by value from its own host buffer, read at each launch: whoever holds it may
    re-encode it between calls (tma.TiledMap.encode) for the call's addresses.
    dependent: launched as a programmatic dependent of the stream's previous kernel (see launch_dependent, which
    checks that the device and driver allow it)."""
    __slots__ = ("_fn", "_grid", "_block", "_smem", "_vals", "_ptrs", "_cv", "_slots", "_pa", "_dep", "_lead",
                 "_maps", "_vaddr")

    def __init__(self, kernel, grid, block, args, n_pointers, shared_mem=0, dependent=False):
        self._fn = _driver_function(kernel).ptr
        self._dep = dependent
        grid, block = _dims(grid), _dims(block)
        self._grid, self._block = grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block))
        self._smem = int(shared_mem)
        self._vals = np.zeros(len(args), dtype=np.uint64)  # one 8-byte slot per argument, value in its low bytes
        raw = self._vals.view(np.uint8)
        self._maps = {}
        for i, a in enumerate(args):
            if a is None:  # a dynamic slot
                continue
            if type(a) is TensorMap:
                self._maps[i] = a
            elif backend.is_cuda_array(a):
                self._vals[i] = a.data.ptr
            else:
                b = np.asarray(a).tobytes()
                raw[8 * i:8 * i + len(b)] = np.frombuffer(b, dtype=np.uint8)
        self._ptrs = self._vals.ctypes.data + 8 * np.arange(len(args), dtype=np.uint64)
        for i, m in self._maps.items():
            self._ptrs[i] = m.address
        # a ctypes view of the slots (cheaper to write than a NumPy slice) and the parameter array's address, read
        # once (`ndarray.ctypes` costs over a microsecond per access)
        self._vaddr = int(self._vals.ctypes.data)  # the slots' address (the C launch of flame_core/csrc/pointwise.c)
        self._cv = (ctypes.c_uint64 * self._vals.size).from_address(self._vaddr)
        self._pa = int(self._ptrs.ctypes.data)
        self._slots = tuple(range(n_pointers)) if type(n_pointers) is int else tuple(int(i) for i in n_pointers)
        # the dynamic slots are the first k (every per-op launch): one slice store writes them all
        self._lead = len(self._slots) if self._slots == tuple(range(len(self._slots))) else -1

    def __call__(self, values):
        """Launch with these raw 8-byte values (ints, one per dynamic slot, in order) in the dynamic slots: a device
        address, or a scalar's bit pattern in the low bytes (`f32_bits(v)` for a `float` parameter)."""
        global launches
        launches += 1
        cv = self._cv
        lead = self._lead
        if lead >= 0 and len(values) == lead:
            cv[:lead] = values
        else:
            for i, v in zip(self._slots, values):
                cv[i] = v
        if self._dep:
            self._launch_dependent()
            return
        g0, g1, g2 = self._grid
        b0, b1, b2 = self._block
        _driver_launch(self._fn, g0, g1, g2, b0, b1, b2, self._smem, _current_stream().ptr, self._pa, 0)

    launch_raw = __call__

    def launch2(self, a, b):
        """`self((a, b))` for a launch whose dynamic slots are its first two (the per-op path: no tuple, no loop)."""
        if self._dep or self._lead != 2:
            return self((a, b))
        global launches
        launches += 1
        cv = self._cv
        cv[0] = a
        cv[1] = b
        g, bl = self._grid, self._block
        _driver_launch(self._fn, g[0], g[1], g[2], bl[0], bl[1], bl[2], self._smem, _current_stream().ptr, self._pa, 0)

    def launch3(self, a, b, c):
        """`self((a, b, c))` for a launch whose dynamic slots are its first three (see launch2)."""
        if self._dep or self._lead != 3:
            return self((a, b, c))
        global launches
        launches += 1
        cv = self._cv
        cv[0] = a
        cv[1] = b
        cv[2] = c
        g, bl = self._grid, self._block
        _driver_launch(self._fn, g[0], g[1], g[2], bl[0], bl[1], bl[2], self._smem, _current_stream().ptr, self._pa, 0)

    def _launch_dependent(self):
        g, b = self._grid, self._block
        cuda = backend.cupy.cuda
        attr = _LaunchAttribute()
        attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1
        cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], self._smem, cuda.get_current_stream().ptr,
                            ctypes.pointer(attr), 1)
        err = _cu_launch_ex()(ctypes.byref(cfg), self._fn, self._pa, None)
        if err:
            raise cuda.driver.CUDADriverError(err)


class LaunchCache:
    """What a kernel wrapper keeps per call configuration (PackedLaunches, with the grid and scalars they fix), per
    thread (a PackedLaunch's buffer is rewritten at each call) and per device (a PackedLaunch holds one device's
    function: the current device is part of every key). The wrapper's key holds every shape, dtype, flag and scalar
    that fixes the launch. Past `limit` configurations a thread's cache is cleared and rebuilt on demand (a stream of
    distinct shapes stays bounded)."""
    __slots__ = ("_local", "limit")

    def __init__(self, limit=1024):
        self._local = threading.local()
        self.limit = limit

    def get(self, key):
        try:
            d = self._local.d
        except AttributeError:  # this thread's first call
            d = self._local.d = {}
        return d.get((_device_id(), key))

    def put(self, key, value):
        """Keep `value` for `key` on the current device (call after a `get` of this thread) and return it."""
        d = self._local.d
        if len(d) >= self.limit:
            d.clear()
        d[(_device_id(), key)] = value
        return value

    def __len__(self):
        return len(getattr(self._local, "d", None) or ())

    def clear(self):
        """Drop this thread's entries (tests; a kernel reload)."""
        self._local.d = {}


def _driver_error(status):
    """Raise CuPy's error for a failed driver call (the C launch's, flame_core/csrc/pointwise.c)."""
    raise backend.cupy.cuda.driver.CUDADriverError(int(status))


# bound once: the per-launch path reads no module attributes of CuPy
_driver_launch = backend.cupy.cuda.driver.launchKernel if backend.cupy is not None else None
_current_stream = backend.cupy.cuda.get_current_stream if backend.cupy is not None else None
_device_id = backend.cupy.cuda.runtime.getDevice if backend.cupy is not None else (lambda: 0)


def f32(v):
    return np.float32(v)


def i32(v):
    v = int(v)
    if not -2 ** 31 <= v < 2 ** 31:
        raise ValueError(f"kernel argument {v} does not fit in int32")
    return np.int32(v)


def i64(v):
    return np.int64(v)


def u32(v):
    v = int(v)
    if not 0 <= v < 2 ** 32:
        raise ValueError(f"kernel argument {v} does not fit in uint32")
    return np.uint32(v)


def null():
    """A null pointer argument."""
    return np.uint64(0)


def f32_bits(v):
    """The bit pattern of float32(v) as an int: the raw slot value of a `float` kernel parameter (PackedLaunch)."""
    return int(np.float32(v).view(np.uint32))
