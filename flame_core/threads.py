"""CPU threads: the BLAS that NumPy calls for the cpu backend's matmuls, sized as PyTorch sizes its intra-op pool.

The pool is the physical cores this process may run on; `FLAME_NUM_THREADS=n` (read at import) or
`set_num_threads(n)` change it, `get_num_threads()` reads it (PyTorch's names). As PyTorch runs work below a grain
size inline on the calling thread, a GEMM below `PARALLEL_MACS` multiply-adds runs on one BLAS thread, and only a
larger one spreads over the pool: a small GEMM split across threads finishes only when its slowest thread does, and on
a busy machine that thread waits for a time slice (the figures: BENCHMARKS.md, "CPU threads (issue 25)").

So the BLAS is set to one thread at import and raised to the pool around each large GEMM (`matmul`). When the user
configured the BLAS (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS or MKL_NUM_THREADS set, FLAME_NUM_THREADS not), FLAME
leaves it as configured. The BLAS setting is process-wide: NumPy code of the user's own runs on one thread too.
"""
import glob
import os
import warnings

import numpy as np

from . import backend

PARALLEL_MACS = 1 << 27  # ~ 512³: below it the threads' synchronisation costs more than it saves (BENCHMARKS.md)
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

_blas = None         # threadpoolctl's controllers of the BLAS libraries NumPy loaded (None: not managed)
_num_threads = 1


def physical_cores():
    """Physical cores among the CPUs this process may run on (hyper-threads of one core count once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        siblings = glob.glob(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            with open(siblings[0]) as f:
                cores.add(f.read().strip())
        except (IndexError, OSError):
            cores.add(str(c))
    return max(1, len(cores))


def _env_threads():
    return backend.env_positive_int("FLAME_NUM_THREADS")


def _controller():
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # a declared dependency; without it FLAME cannot see or size the BLAS
        return None
    return ThreadpoolController()


def _init():
    global _blas, _num_threads
    n = _env_threads()
    ctl = _controller()
    if ctl is None and n is not None:
        raise ImportError(f"FLAME_NUM_THREADS={n} needs threadpoolctl to size the BLAS: pip install threadpoolctl")
    if ctl is None:
        warnings.warn("threadpoolctl is not installed (pip install threadpoolctl): FLAME leaves the BLAS threads "
                      "as NumPy set them", RuntimeWarning, stacklevel=2)
    if ctl is None or (n is None and any(k in os.environ for k in _BLAS_ENV)):
        # the user sized the BLAS (or it cannot be sized): leave it, and report what it uses
        if ctl is not None:
            _num_threads = max([i["num_threads"] for i in ctl.info() if i["user_api"] == "blas"] or [1])
        else:
            raw = next((os.environ[k] for k in _BLAS_ENV if k in os.environ), "")
            _num_threads = int(raw) if raw.isdigit() and int(raw) > 0 else os.cpu_count() or 1
        return
    _blas = ctl.select(user_api="blas").lib_controllers or None
    _num_threads = n or physical_cores()
    _set_blas(1)


def _set_blas(n):
    for lib in _blas or ():
        lib.set_num_threads(n)


def get_num_threads():
    """The CPU threads a large matmul uses (torch.get_num_threads)."""
    return _num_threads


def set_num_threads(n):
    """Use `n` CPU threads for large matmuls (torch.set_num_threads); small ones stay on one."""
    global _blas, _num_threads
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"set_num_threads expects a positive integer, got {n!r}")
    if _blas is None:  # the BLAS was left to the user's environment variables: from now on FLAME sizes it
        ctl = _controller()
        if ctl is None:
            raise ImportError("set_num_threads needs threadpoolctl: pip install threadpoolctl")
        _blas = ctl.select(user_api="blas").lib_controllers or None
        _set_blas(1)
    _num_threads = int(n)


def matmul(a, b, out=None):
    """np.matmul(a, b) with the pool's threads when the product is large, else one."""
    if _blas is None or _num_threads == 1 or a.ndim == 0 or b.ndim == 0:
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    if a.ndim == 2 and b.ndim == 2:   # the common case: no batch (np.broadcast_shapes costs a few µs)
        (m, k), n = a.shape, b.shape[1]
        batch = 1
    else:
        m = a.shape[-2] if a.ndim > 1 else 1
        k = a.shape[-1]
        n = b.shape[-1] if b.ndim > 1 else 1
        batch = 1
        for s in np.broadcast_shapes(a.shape[:-2], b.shape[:-2]):
            batch *= s
    if batch * m * n * k < PARALLEL_MACS:
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    _set_blas(_num_threads)
    try:
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    finally:
        _set_blas(1)


_init()
