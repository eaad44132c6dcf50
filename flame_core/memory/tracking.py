"""Where tensors are created: an optional, costly record of the first user frame at each tensor's birth.

Off by default (tags then hold only shape and dtype; on cuda they are written on demand, see memory.cuda). Turn on
with `set_tracking(True)` or the environment variable FLAME_MEMORY_TRACKING=1; OOM reports and the profiler then name
the creating line.
"""
import os
import sys

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../flame_core/
_enabled = os.environ.get("FLAME_MEMORY_TRACKING", "0").strip().lower() not in ("0", "", "false", "no", "off")


def set_tracking(enabled=True):
    """Record the creating source line of every tensor (for OOM reports and the profiler)."""
    global _enabled
    _enabled = bool(enabled)
    cuda = sys.modules.get("flame_core.memory.cuda")
    if cuda is not None:  # the pool tags blocks at birth only while tracking (or a profiler) needs it then
        cuda.refresh_birth()


def is_tracking():
    return _enabled


def origin(skip=2):
    """'file:line in function' of the innermost frame outside flame_core (None when there is none)."""
    f = sys._getframe(skip)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_PKG_DIR):
            return f"{fn}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None
