"""glibc's malloc thresholds for the cpu backend's arrays.

NumPy takes an array's memory from malloc. glibc serves a block of 128 KiB or more (its starting mmap threshold,
raised as such blocks are freed, to 32 MiB at most) with a fresh mmap, and gives the top of its heap back to the
system past its trim threshold (twice the mmap threshold): a training step's new activation and gradient arrays then
start as untouched pages, each 4 KiB page faulted in on its first write. The CPU demo took 1.33 million minor page
faults, 3.5 s of system time in a 39 s run. Fixed thresholds -- blocks below MMAP_THRESHOLD from the heap, the heap
trimmed only past TRIM_THRESHOLD free at its top -- let a step reuse the memory the last one freed: 34 thousand
faults, 0.2 s (BENCHMARKS.md, "CPU demo").

Applied at import on glibc, unless the process set the thresholds itself (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, or GLIBC_TUNABLES naming glibc.malloc) or FLAME_CPU_MALLOC=0. The setting is process-wide,
as the BLAS threads' (threads.py); its cost is up to TRIM_THRESHOLD of freed memory the process keeps.
"""
import ctypes
import os

from . import backend

MMAP_THRESHOLD = 32 << 20   # glibc's own ceiling for its moving threshold
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

applied = False   # whether tune() set the thresholds in this process


def _glibc():
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):   # not glibc, or no confstr (not POSIX)
        return False


def _user_set():
    return any(k in os.environ for k in _USER_VARS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def tune():
    """Set glibc's mmap and trim thresholds to MMAP_THRESHOLD / TRIM_THRESHOLD; True when they were set (False: off
    through FLAME_CPU_MALLOC=0, set by the user's environment, or not glibc)."""
    global applied
    if not backend.env_flag("FLAME_CPU_MALLOC") or _user_set() or not _glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return applied


tune()
