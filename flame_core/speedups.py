"""The C extension flame_core._speedups (sources in flame_core/csrc/), built by the install where a C compiler is
found: the eager per-op hot paths without the interpreter -- Function.apply (csrc/apply.c), tensor birth (tensor.c),
the small-array pointwise entry points with their launches (pointwise.c) and the small-array bin's hooks
(recycle.c). Each has a Python version that stays its specification and the fallback.

``module``
    The extension, or None: not built, or FLAME_SPEEDUPS=0 (read once, at import).
``error``
    Why a built extension did not import (its ImportError as text), else None.
"""
import importlib

from .backend import env_flag

error = None


def _load():
    global error
    if not env_flag("FLAME_SPEEDUPS"):
        return None
    name = __name__.rpartition(".")[0] + "._speedups"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if not (isinstance(e, ModuleNotFoundError) and e.name == name):  # built, but it did not load
            error = f"{type(e).__name__}: {e}"
        return None


module = _load()
