"""Prebuilt kernel binaries: fatbins that tools/build_kernels.py compiles with nvcc from cuda_src, shipped in
flame_core/kernels/binaries/, so that a fresh machine loads its kernels instead of compiling them through NVRTC.

A *unit* is what one NVRTC compile of the loader covers: cuda_src/<stem>.cu with every single-parameter template
kernel instantiated for one dtype (plus the multi-parameter expressions the build lists for it), or a file without
templates (dtype None). `manifest.json` records per unit:

``key``
    sha256 of the expanded source (local headers inlined, as NVRTC gets it) and the compile options: the loader
    recomputes it from the sources it runs with and uses the binary only when they are equal, so that an edited
    kernel is never served by a stale binary (it compiles through NVRTC instead).
``names``
    name expression -> lowered (mangled) name, as NVRTC's ``nvrtcGetLoweredName`` gives it; ``c_names`` the
    ``extern "C"`` kernels.
``files``
    arch -> {path, sha256, names, c_names}: one fatbin per architecture (``sm_90a`` for the files whose ``// arch:``
    line asks for it; ``compute_XY``: PTX, which the driver compiles for newer devices when it loads it). A cubin for
    ``sm_XY`` runs on every device ``XZ`` with ``Z >= Y`` of the same major (``sm_80`` on 8.6 and 8.9), an ``sm_XYa``
    one on ``XY`` only; devices the manifest has no binary for compile through NVRTC.

``FLAME_PREBUILT_KERNELS=0`` turns the binaries off (everything compiles through NVRTC, as before they existed).
"""
import hashlib
import json
import os
from pathlib import Path

FORMAT = 1
DIR = Path(__file__).resolve().parent / "binaries"
MANIFEST = DIR / "manifest.json"
# what nvcc gets besides -gencode: the loader's NVRTC_OPTIONS plus the -ftz=true that CuPy appends to every
# NVRTC compile (cupy.cuda.compiler._compile_with_cache_cuda); NVRTC's other defaults are nvcc's
EXTRA_OPTIONS = ("-ftz=true",)


def unit_name(stem, dtype_name):
    return f"{stem}:{dtype_name or ''}"


def key(source_text, options):
    """The staleness key of a unit: its expanded source and compile options (independent of the architecture)."""
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, list(options)]).encode())
    h.update(b"\0")
    h.update(source_text.encode())
    return h.hexdigest()


_manifest = []


def manifest():
    """The shipped manifest (dict), {} when there is none or FLAME_PREBUILT_KERNELS=0 (read once per process;
    a manifest that does not parse is treated as absent: NVRTC compiles everything)."""
    if os.environ.get("FLAME_PREBUILT_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return {}
    if not _manifest:
        try:
            m = json.loads(MANIFEST.read_text())
            if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("units"), dict):
                m = {}
        except (OSError, ValueError):
            m = {}
        _manifest.append(m)
    return _manifest[0]


def arch_for(archs, cc, exact=None):
    """The architecture among `archs` (e.g. {"sm_80", "sm_90", "compute_120"}) whose code runs on a device of compute
    capability `cc` ("86"): an exact match first, else the newest sm_XY of the same major with Y <= the device's
    minor, else the newest PTX (compute_XY, XY <= cc: the driver compiles it at load); an `exact` arch ("sm_90a")
    only on its own device. None when none runs there."""
    if exact is not None:
        return exact if exact in archs and exact[3:].rstrip("a") == cc else None
    if f"sm_{cc}" in archs:
        return f"sm_{cc}"
    major, minor = cc[:-1], int(cc[-1])
    ok = [a for a in archs if a.startswith("sm_") and not a.endswith("a") and a[3:-1] == major
          and int(a[-1]) <= minor]
    if ok:
        return max(ok, key=lambda a: int(a[-1]))
    ptx = [a for a in archs if a.startswith("compute_") and not a.endswith("a") and int(a[8:]) <= int(cc)]
    return max(ptx, key=lambda a: int(a[8:])) if ptx else None
