"""Process groups: who takes part (rank, world size), how they meet (the TCP store) and which backend moves the data.

    import flame_core.distributed as dist
    dist.init_process_group()              # from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
    dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()

backend: "nccl" (GPUs; the default when CuPy sees one) or "store" (the cpu: data through the TCP store). With
"nccl" the rank's GPU is LOCAL_RANK: it becomes CuPy's current device and FLAME's default device (so
`flame.default_device()` is this rank's GPU; a literal "cuda" still means cuda:0).
"""
import atexit
import datetime
import faulthandler
import os
import sys
import warnings

from .. import backend as _backend
from .env import DistributedError, read_env
from .store import StoreTimeoutError, TCPStore, seconds
from .store_wire import SECRET_ENV

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
BACKENDS = ("nccl", "store")


class ProcessGroup:
    """A set of ranks sharing a store and a backend. `rank()` / `size()` as torch's."""

    def __init__(self, store, rank, world_size, backend="store", device_index=None, prefix="default",
                 timeout=DEFAULT_TIMEOUT):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        if not 0 <= rank < world_size:
            raise DistributedError(f"rank {rank} is not in 0..{world_size - 1}")
        self.store, self._rank, self._size, self.prefix = store, int(rank), int(world_size), prefix
        self.timeout = seconds(timeout)
        self.backend_name = backend
        self._barriers = 0
        if backend == "nccl":
            from .nccl import NCCLBackend
            self.device_index = 0 if device_index is None else int(device_index)
            self.backend = NCCLBackend(store, self._rank, self._size, self.device_index, prefix)
        else:
            from .store_backend import StoreBackend
            self.device_index = None
            self.backend = StoreBackend(store, self._rank, self._size, prefix)

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    @property
    def device(self):
        """The device this group's collectives take tensors on: cuda:LOCAL_RANK for nccl; None (any: the data goes
        through host memory) for store."""
        from ..device import device
        return None if self.device_index is None else device(f"cuda:{self.device_index}")

    def barrier(self, timeout=None):
        """Block until every rank of the group got here (the GPU's queued work first finishes on this rank); a
        rank that does not arrive in time is named in the DistributedError."""
        self._barriers += 1
        base = f"{self.prefix}/barrier{self._barriers}"
        if self.backend_name == "nccl":
            self.backend.synchronize()
            _backend.cupy.cuda.get_current_stream().synchronize()
        self.store.set(f"{base}/{self._rank}", b"1")
        keys = [f"{base}/{r}" for r in range(self._size)]
        wait = self.timeout if timeout is None else seconds(timeout)
        try:
            self.store.wait(keys, wait)
        except StoreTimeoutError:
            missing = [r for r in range(self._size) if not self.store.check([keys[r]])]
            raise DistributedError(f"barrier {self._barriers}: rank(s) {missing} of {self._size} did not arrive "
                                   f"within {wait:g} s") from None
        if self.store.add(f"{base}/left", 1) == self._size:
            for k in keys + [f"{base}/left"]:
                self.store.delete_key(k)

    def close(self, wait_for_others=True):
        """Free the backend; rank 0 (which hosts the store) first waits a little for the others to close theirs,
        so that none loses the store in its last calls."""
        if self.backend is None:
            return
        self.backend.close()
        self.backend = None
        try:
            self.store.set(f"{self.prefix}/closed/{self._rank}", b"1")
            if wait_for_others and self.store.is_master:
                self.store.wait([f"{self.prefix}/closed/{r}" for r in range(self._size)],
                                timeout=min(self.timeout, 60.0))
        except Exception:  # noqa: BLE001 - closing: a rank already gone must not fail the others' exit
            pass


# ----------------------------------------------------------------------------- the default group
_default = None
_atexit_registered = False


def init_process_group(backend=None, init_method=None, timeout=DEFAULT_TIMEOUT, world_size=-1, rank=-1, store=None,
                       device_id=None):
    """Join the job (torch.distributed.init_process_group). init_method: "env://" (default: the launcher's
    environment, see env.py) or "tcp://host:port" (with rank and world_size). store: a TCPStore to meet through
    instead (with rank and world_size). device_id: the GPU index (default LOCAL_RANK). Returns the group."""
    global _default, _atexit_registered
    if _default is not None:
        raise DistributedError("the default process group is already initialized (destroy_process_group() first)")
    if backend is None:
        backend = "nccl" if _backend.cuda_available() else "store"
    backend = str(backend).lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} ('store' moves data through the "
                         f"TCP store: the cpu backend)")
    if backend == "nccl":
        from .nccl import load_nccl
        load_nccl()  # what is missing is said before any rank waits for another
    rank = None if rank is None or rank < 0 else int(rank)
    world_size = None if world_size is None or world_size < 0 else int(world_size)
    t = seconds(timeout)
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("init_process_group(store=...) needs rank and world_size")
        local = rank if device_id is None else int(device_id)
    else:
        env = read_env(rank, world_size)
        rank, world_size, local = env.rank, env.world_size, env.local_rank
        addr, port = env.master_addr, env.store_port
        if init_method not in (None, "env://"):
            if not str(init_method).startswith("tcp://"):
                raise ValueError(f"init_method must be 'env://' or 'tcp://host:port', got {init_method!r}")
            hostport = str(init_method)[len("tcp://"):]
            addr, _, p = hostport.rpartition(":")
            if not addr or not p.isdigit():
                raise ValueError(f"init_method {init_method!r}: expected tcp://host:port")
            addr, port = addr.strip("[]"), int(p)
        store = TCPStore(addr, port, world_size, is_master=rank == 0, timeout=t)
        if rank == 0 and world_size > 1 and not os.environ.get(SECRET_ENV):  # (only loopback gets this far)
            warnings.warn(f"{SECRET_ENV} is not set: the store on {addr}:{store.port} (loopback) admits any process "
                          f"of this machine; FLAME's launcher sets one per run, otherwise export the same random "
                          f"value to every rank", stacklevel=2)
        if device_id is not None:
            local = int(device_id)
    if backend == "nccl":
        _use_device(local)
    group = ProcessGroup(store, rank, world_size, backend, device_index=local if backend == "nccl" else None,
                         timeout=t)
    _default = group
    if not _atexit_registered:
        atexit.register(_close_at_exit)
        _atexit_registered = True
    group.barrier()  # everyone joined: nobody runs ahead into collectives of a half-made job
    _arm_hang_dump(rank)
    return group


def _arm_hang_dump(rank):
    """FLAME_DIST_HANG_DUMP=S: every S seconds, every thread's Python stack to stderr (a hung collective shows
    where each rank waits; the launcher prefixes the lines with the rank)."""
    raw = os.environ.get("FLAME_DIST_HANG_DUMP", "")
    if not raw:
        return
    try:
        every = float(raw)
    except ValueError:
        raise DistributedError(f"FLAME_DIST_HANG_DUMP must be a number of seconds, got {raw!r}") from None
    if every <= 0:
        raise DistributedError(f"FLAME_DIST_HANG_DUMP must be positive, got {raw!r}")
    faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)


def _use_device(index):
    n = _backend.cupy.cuda.runtime.getDeviceCount()
    if not 0 <= index < n:
        raise DistributedError(f"LOCAL_RANK {index} but CuPy sees {n} GPU(s); start at most {n} ranks per machine")
    _backend.cupy.cuda.Device(index).use()
    from ..device import set_default_device
    set_default_device(f"cuda:{index}")


def _close_at_exit():
    if _default is not None:
        destroy_process_group()


def is_available():
    return True


def is_nccl_available():
    try:
        from .nccl import load_nccl
        load_nccl()
        return True
    except DistributedError:
        return False


def is_initialized():
    return _default is not None


def _group(group=None):
    if group is not None:
        return group
    if _default is None:
        raise DistributedError("the default process group has not been initialized: call "
                               "flame_core.distributed.init_process_group() first")
    return _default


def default_group():
    """The group init_process_group made (torch's group.WORLD); DistributedError before it."""
    return _group()


def get_rank(group=None):
    return _group(group).rank()


def get_world_size(group=None):
    return _group(group).size()


def get_backend(group=None):
    return _group(group).backend_name


def barrier(group=None, timeout=None):
    _group(group).barrier(timeout)


def destroy_process_group(group=None):
    """Close the group (default: the default group, and its store)."""
    global _default
    g = _group(group)
    g.close()
    if g is _default:
        _default = None
        g.store.close()
        if os.environ.get("FLAME_DIST_HANG_DUMP"):
            faulthandler.cancel_dump_traceback_later()
