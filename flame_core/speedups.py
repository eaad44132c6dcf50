"""The C extension flame_core._speedups (sources in flame_core/csrc/), built by the install where a C compiler is
found: the eager per-op hot paths (Function.apply, the small-array bin's hooks) without the interpreter. Each has a
Python version that stays its specification and the fallback.

``module``
    The extension, or None: not built, or FLAME_SPEEDUPS=0 (read once, at import).
"""
import os


def _load():
    if os.environ.get("FLAME_SPEEDUPS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from . import _speedups
    except ImportError:
        return None
    return _speedups


module = _load()
