"""The "nccl" backend: NVIDIA's NCCL through CuPy (`cupy.cuda.nccl`), one communicator per group and GPU.

Every collective runs on the group's own communication stream: it first waits on an event recorded on the caller's
current stream (so it sees the work queued before it), then NCCL's kernel is enqueued, then an event after it is
the Work's. `Work.wait()` makes the caller's current stream wait on that event -- the host never blocks -- and a
synchronous collective does the same at once. No host synchronisation anywhere, so the collectives can be captured
in a CUDA graph: inside a capture the communication stream joins it through the first event and is joined back by
`wait_all()` (DistributedDataParallel calls it at the end of backward).

The NCCL unique id is made by rank 0 and passed through the store. NVLink multicast (NVLS) stays off: the
communicator is created with NCCL_NVLS_ENABLE=0 whatever the environment says.
"""
import ctypes
import gc
import importlib.util
import os
import platform
import warnings

import numpy as np

from .. import backend as _backend
from ..cuda.graphs import is_capturing, note_capture_use, release_graphs_of
from ..errors import DTypeError
from .base import Backend, ReduceOp, Work
from .env import DistributedError

_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}  # ncclRedOp_t
_TYPES = {"int8": 0, "uint8": 1, "bool": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
          "float32": 7, "float64": 8, "bfloat16": 9}  # ncclDataType_t
NCCL_AVG_VERSION = 21000  # ncclAvg and ncclBfloat16 came with NCCL 2.10


def load_nccl():
    """CuPy's NCCL module; a DistributedError saying what to install when CuPy, a GPU or libnccl is missing."""
    if _backend.cupy is None:
        raise DistributedError("backend 'nccl' needs CuPy (pip install flame-diffusion[cuda12] or [cuda13]); "
                               "without a GPU use backend='store'")
    if not _backend.cuda_available():
        raise DistributedError("backend 'nccl' needs a CUDA GPU, and CuPy sees none; without a GPU use "
                               "backend='store'")
    from cupy.cuda import nccl
    if getattr(nccl, "available", False):
        return nccl
    # CuPy looks for libnccl.so.2 on the loader's path; the pip wheel (nvidia-nccl-cu12 / -cu13) keeps it in
    # site-packages/nvidia/nccl/lib: load it first, then CuPy's binding links against it
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations if spec is not None else []):
        lib = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(lib):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                from cupy_backends.cuda.libs import nccl as bound
                return bound
            except (OSError, ImportError):
                break
    raise DistributedError("CuPy cannot load NCCL (libnccl.so.2): install it (pip install nvidia-nccl-cu12, or "
                           "-cu13 for CUDA 13, or the system package) or add its folder to LD_LIBRARY_PATH")


class _NCCLWork(Work):
    def __init__(self, event, keep):
        self.event, self.keep = event, keep
        self.captured = is_capturing()  # an event never crosses a capture boundary

    def wait(self, timeout=None):
        if self.keep is not None:
            if self.captured != is_capturing():
                raise DistributedError("Work.wait(): the collective was issued " + ("inside" if self.captured else
                                       "outside") + " a CUDA graph capture and waited on across its boundary; wait "
                                       "on it on the same side")
            _backend.cupy.cuda.get_current_stream().wait_event(self.event)
            self.keep = None  # the caller's stream is now ordered after the collective: its tensors may go
        return True

    def is_completed(self):
        return self.event.done

    def synchronize(self):
        self.event.synchronize()
        self.keep = None

    def __del__(self):
        # a handle dropped unwaited still orders the caller's stream (its tensors may be reused), where it can
        try:
            if self.keep is not None and self.captured == is_capturing():
                self.wait()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _signed(raw):
    return tuple(b - 256 if b > 127 else b for b in raw)


class NCCLBackend(Backend):
    name = "nccl"

    def __init__(self, store, rank, world_size, device_index, prefix):
        self.nccl = load_nccl()
        cp = _backend.cupy
        n_dev = cp.cuda.runtime.getDeviceCount()
        if not 0 <= device_index < n_dev:
            raise DistributedError(f"rank {rank} wants GPU {device_index} (LOCAL_RANK) but CuPy sees {n_dev} "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start "
                                   f"at most {n_dev} ranks per machine")
        if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
            warnings.warn(f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} ignored: FLAME keeps NVLink multicast "
                          f"off (NCCL_NVLS_ENABLE=0)", RuntimeWarning, stacklevel=3)
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # read by NCCL when the communicator is created
        self.rank, self.world, self.device_index = rank, world_size, device_index
        self.version = self.nccl.get_version()
        self.native_avg = self.version >= NCCL_AVG_VERSION
        key = f"{prefix}/nccl_unique_id"
        with cp.cuda.Device(device_index):
            if rank == 0:
                uid = self.nccl.get_unique_id()
                raw = bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(b % 256 for b in uid)
                store.set(key, raw)
            else:
                raw = store.get(key)
            self.comm = self._communicator(world_size, raw, rank)
            self.stream = cp.cuda.Stream(non_blocking=True)
        self.tail = None

    def _communicator(self, world_size, raw, rank):
        """NcclCommunicator from the unique id's 128 bytes, in the form this CuPy takes: bytes (CuPy 14), else a
        tuple of C chars (signed on x86, unsigned elsewhere)."""
        try:
            return self.nccl.NcclCommunicator(world_size, raw, rank)
        except TypeError:
            pass
        signed = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
        try:
            return self.nccl.NcclCommunicator(world_size, _signed(raw) if signed else tuple(raw), rank)
        except OverflowError:   # char is unsigned on this platform after all
            return self.nccl.NcclCommunicator(world_size, tuple(raw), rank)

    # ------------------------------------------------------------------ helpers
    def _type(self, arr):
        name = np.dtype(arr.dtype).name
        t = _TYPES.get(name)
        if t is None:
            raise DTypeError(f"NCCL cannot move a tensor of dtype {name}")
        if t == 9 and self.version < NCCL_AVG_VERSION:
            raise DTypeError(f"bfloat16 collectives need NCCL >= 2.10 (this is {self.version})")
        return t

    def _check(self, *arrs):
        for a in arrs:
            if not _backend.is_cuda_array(a) or a.device.id != self.device_index:
                where = f"cuda:{a.device.id}" if _backend.is_cuda_array(a) else "cpu"
                raise DistributedError(f"this rank's NCCL group works on cuda:{self.device_index}; got a tensor on "
                                       f"{where}")

    def _begin(self):
        cp = _backend.cupy
        if is_capturing():
            note_capture_use(self)  # the graph must go before the communicator (close)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(cp.cuda.get_current_stream())
        self.stream.wait_event(ev)

    def _end(self, keep):
        ev = _backend.cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(self.stream)
        self.tail = (ev, is_capturing())
        return _NCCLWork(ev, keep)

    def _op(self, op, arr):
        if op is ReduceOp.AVG and not self.native_avg:
            return _OPS[ReduceOp.SUM]
        return _OPS[op]

    def _scale_avg(self, op, arr):
        if op is ReduceOp.AVG and not self.native_avg:
            with self.stream:
                arr *= arr.dtype.type(1.0 / self.world)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, arr, op):
        self._check(arr)
        t = self._type(arr)
        with _backend.cupy.cuda.Device(self.device_index):
            self._begin()
            self.comm.allReduce(arr.data.ptr, arr.data.ptr, arr.size, t, self._op(op, arr), self.stream.ptr)
            self._scale_avg(op, arr)
            return self._end((arr,))

    def broadcast(self, arr, src):
        self._check(arr)
        t = self._type(arr)
        with _backend.cupy.cuda.Device(self.device_index):
            self._begin()
            self.comm.broadcast(arr.data.ptr, arr.data.ptr, arr.size, t, src, self.stream.ptr)
            return self._end((arr,))

    def all_gather(self, out, inp):
        self._check(out, inp)
        t = self._type(inp)
        with _backend.cupy.cuda.Device(self.device_index):
            self._begin()
            self.comm.allGather(inp.data.ptr, out.data.ptr, inp.size, t, self.stream.ptr)
            return self._end((out, inp))

    def reduce_scatter(self, out, inp, op):
        self._check(out, inp)
        t = self._type(inp)
        with _backend.cupy.cuda.Device(self.device_index):
            self._begin()
            self.comm.reduceScatter(inp.data.ptr, out.data.ptr, out.size, t, self._op(op, inp), self.stream.ptr)
            self._scale_avg(op, out)
            return self._end((out, inp))

    def wait_all(self):
        # an event never crosses a capture boundary: a capture starts after a device synchronisation (what came
        # before is done), and a captured collective was joined inside its graph
        if self.tail is not None and self.tail[1] == is_capturing():
            _backend.cupy.cuda.get_current_stream().wait_event(self.tail[0])

    def synchronize(self):
        self.stream.synchronize()

    def close(self):
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            # ncclCommDestroy waits until no CUDA graph holds the communicator's collectives: drop the dead ones
            # (a trainer kept alive by a reference cycle until exit) and reset the live ones, which cannot
            # replay without it
            gc.collect()
            release_graphs_of(self)
            comm.destroy()
