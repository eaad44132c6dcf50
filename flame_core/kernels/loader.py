"""Finds `cuda_src/*.cu`, compiles them lazily with `cupy.RawModule` (NVRTC) and hands out their kernels.

API (what kernel families and other helpers call)
-------------------------------------------------
``enabled()``
    True when raw kernels should run: CuPy imports, a GPU is visible, ``FLAME_KERNELS`` is not ``0`` (read at every
    call) and no ``reference()`` block is active. Families take the NumPy/CuPy reference path otherwise.
``reference()``
    Context manager forcing the reference path (this thread) - for A/B checks of a kernel against its oracle.
``use_kernel(*arrays)``
    ``enabled()`` and every array a CuPy array of a kernel dtype (float32, float16, bfloat16).
``get_function(file_stem, kernel_name, dtype=None)`` -> ``cupy.RawKernel``
    ``dtype=None``: an ``extern "C"`` kernel. Otherwise ``kernel_name`` is a ``template <typename T>`` kernel
    instantiated for the array dtype (float32 -> ``float``, float16 -> ``__half``, bfloat16 -> ``__nv_bfloat16``,
    float64 -> ``double``). A name with more template arguments is written with a ``{T}`` placeholder, e.g.
    ``get_function("norms", "ln_fwd<{T}, 8>", x.dtype)``.
``load_module(file_stem, name_expressions=())`` -> ``cupy.RawModule``
    The compiled module itself (for ``extern "C"`` families such as philox).
``file_arch(file_stem)`` / ``arch_available(arch)``
    A file whose source has a ``// arch: sm_90a`` line is compiled for exactly that architecture (CuPy compiles the
    rest for the device's generic ``sm_XY``); ``arch_available`` says whether the current device runs such code.
``ctype(dtype)``, ``compute_dtype(dtype)``
    The CUDA C type name for an array dtype (raises DTypeError for the unsupported ones); the dtype the references
    compute in.

Launching is in `launching`, launch geometry in `plans`, the column sums in `column_sum`, warming the disk cache in
`precompile`.

Compilation
-----------
``#include "x.cuh"`` lines naming files in cuda_src are inlined here, each wrapped in ``#line`` directives, so that
NVRTC reports errors against the real file and line, and so that CuPy's disk cache (``CUPY_CACHE_DIR``, keyed on
the full source, options and name expressions) sees header edits. Every ``template <typename T> __global__`` kernel of a
file is instantiated at once for a dtype: one NVRTC compile per (file, dtype). Templates with more parameters (or
declared through macros) compile per expression. Compile errors raise ``flame_core.errors.KernelCompileError``
naming the file and line.

Prebuilt binaries
-----------------
Before compiling, ``load_module`` looks for a shipped nvcc-built binary holding the module's kernels
(flame_core/kernels/prebuilt.py: built by tools/build_kernels.py with NVRTC's options, one fatbin per (file, dtype)
and architecture, carrying the families' default multi-parameter instantiations too). It is used only when the
sources' key (a hash of the expanded source and options) equals the one recorded at build time and a binary runs on
the device; otherwise, and with ``FLAME_PREBUILT_KERNELS=0``, NVRTC compiles as above. ``stats`` and ``nvrtc_log``
count what preparing kernels cost this process (bench/cold_start.py).
"""
import contextlib
import os
import re
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import backend
from ..errors import DTypeError, KernelCompileError


def _find_cuda_src():
    """The folder holding the .cu/.cuh files: $FLAME_CUDA_SRC overrides; else the copy a wheel ships
    (flame_core/cuda_src), else the source tree's cuda_src/."""
    pkg = Path(__file__).resolve().parents[1]
    if os.environ.get("FLAME_CUDA_SRC"):
        return Path(os.environ["FLAME_CUDA_SRC"])
    return next((p for p in (pkg / "cuda_src", pkg.parent / "cuda_src") if p.is_dir()), pkg.parent / "cuda_src")


CUDA_SRC = _find_cuda_src()
NVRTC_OPTIONS = ("--std=c++17",)

_local = threading.local()
_lock = threading.Lock()
_modules = {}     # (stem, name_expressions) -> RawModule
_sources = {}     # stem -> expanded source text

_CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double"}
# a trailing // comment allowed
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*(?://[^\n]*)?$', re.M)
_TEMPLATE_KERNEL = re.compile(
    r"template\s*<\s*typename\s+\w+\s*>\s*__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_ERROR_LINE = re.compile(r'^(?:"?([^"(\s]+)"?)\((\d+)\): (error|warning|catastrophic error)', re.M)


# ----------------------------------------------------------------------------- switches
# FLAME_KERNELS is read at every call, straight from os.environ's backing dict (os.environ.get encodes the key and
# decodes the value each time: most of a microsecond on the per-op path). `_state` caches the parse of the value last
# seen, keyed by identity (setting the variable stores a new bytes object), and counts the reference() blocks open in
# any thread, so that the per-op check reads the thread-local count only while one is open. pointwise_small reads
# `_state` inline (no frame); every other caller goes through enabled().
_env_data = getattr(os.environ, "_data", None)
try:
    _KERNELS_KEY = os.environ.encodekey("FLAME_KERNELS")
except Exception:  # pragma: no cover - a platform whose os.environ lacks the helpers
    _env_data = None
_UNSEEN = object()
_state = [_UNSEEN, True, 0]  # [raw FLAME_KERNELS value last seen (None: unset), its flag, reference() blocks open]
_ref_lock = threading.Lock()


def _kernels_flag():
    if _env_data is None:  # pragma: no cover
        return backend.env_flag("FLAME_KERNELS", True)
    raw = _env_data.get(_KERNELS_KEY)
    st = _state
    if raw is st[0]:
        return st[1]
    flag = raw is None or backend.env_flag("FLAME_KERNELS", True)
    st[0:2] = raw, flag  # one slice store: a reader sees the old pair or the new one
    return flag


def enabled():
    """Whether raw kernels run (CuPy + GPU present, FLAME_KERNELS != 0, no `reference()` block)."""
    if _state[2] and getattr(_local, "force_reference", 0):
        return False
    if not _kernels_flag():
        return False
    return backend.cuda_available()


@contextlib.contextmanager
def reference():
    """Run the NumPy/CuPy reference implementations inside this block (this thread only)."""
    with _ref_lock:
        _state[2] += 1
    _local.force_reference = getattr(_local, "force_reference", 0) + 1
    try:
        yield
    finally:
        _local.force_reference -= 1
        with _ref_lock:
            _state[2] -= 1


def dtype_name(dtype):
    """np.dtype(dtype).name, cached: NumPy computes `.name` in Python (microseconds per read)."""
    n = _dtype_names.get(dtype)
    if n is None:
        n = _dtype_names[dtype] = np.dtype(dtype).name
    return n


_dtype_names = {}
_KERNEL_DTYPES = frozenset(np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16))


def use_kernel(*arrays):
    """True when every array is a CuPy array of a kernel dtype and kernels are enabled."""
    if not enabled():
        return False
    nd = backend._cupy_ndarray
    for a in arrays:
        if a is not None and not (isinstance(a, nd) and a.dtype in _KERNEL_DTYPES):
            return False
    return True


def ctype(dtype):
    name = dtype_name(dtype)
    try:
        return _CTYPES[name]
    except KeyError:
        raise DTypeError(f"no CUDA kernel type for dtype {name} (kernels take float32, float16, bfloat16)") from None


def compute_dtype(dtype):
    """The dtype references compute in: float64 stays, everything else runs in float32 (as the kernels do)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# ----------------------------------------------------------------------------- sources
def _read(path):
    try:
        return path.read_text()
    except FileNotFoundError:
        raise KernelCompileError(f"kernel source {path} not found (looked in {CUDA_SRC}; "
                                 f"set FLAME_CUDA_SRC to the cuda_src folder)") from None


def _expand(path, seen):
    """Inline local includes once each, with #line directives pointing at the original files."""
    text = _read(path)
    out, pos = [f'#line 1 "{path.name}"\n'], 0
    for m in _INCLUDE.finditer(text):
        inc = CUDA_SRC / m.group(1)
        if not inc.exists():
            continue  # a system header (cuda_bf16.h ...): NVRTC resolves it
        out.append(text[pos:m.start()])
        if inc.name not in seen:
            seen.add(inc.name)
            out.append(_expand(inc, seen))
        line = text.count("\n", 0, m.end()) + 2
        out.append(f'\n#line {line} "{path.name}"\n')
        pos = m.end() + 1 if text[m.end():m.end() + 1] == "\n" else m.end()
    out.append(text[pos:])
    return "".join(out)


def source(stem):
    """The expanded source of cuda_src/<stem>.cu (local headers inlined)."""
    s = _sources.get(stem)
    if s is None:
        s = _sources[stem] = _expand(CUDA_SRC / f"{stem}.cu", set())
    return s


def template_kernels(stem):
    """Names of the single-parameter template kernels of a file (instantiated together per dtype)."""
    return _TEMPLATE_KERNEL.findall(source(stem))


# ----------------------------------------------------------------------------- compile
def _compile_error(stem, exc):
    log = str(exc)
    where = [f"{m.group(1)}:{m.group(2)}" for m in _ERROR_LINE.finditer(log) if m.group(3) != "warning"]
    first = where[0] if where else f"{stem}.cu"
    return KernelCompileError(f"NVRTC failed to compile cuda_src/{stem}.cu (first error at cuda_src/{first}):\n{log}")


def load_module(stem, name_expressions=()):
    """The compiled RawModule of cuda_src/<stem>.cu with these template instantiations (cached)."""
    key = (stem, tuple(name_expressions))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    cp = backend.cupy
    if cp is None:
        raise KernelCompileError(f"cannot compile cuda_src/{stem}.cu: CuPy is not installed")
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            t = time.perf_counter()
            mod = _prebuilt_module(stem, key[1])
            if mod is not None:
                stats["prebuilt_loads"] += 1
                stats["prebuilt_seconds"] += time.perf_counter() - t
            else:
                mod = _nvrtc_module(cp, stem, name_expressions)
                stats["nvrtc_compiles"] += 1
                stats["nvrtc_seconds"] += time.perf_counter() - t
                nvrtc_log.append((stem, key[1]))
            _modules[key] = mod
    return mod


def _nvrtc_module(cp, stem, name_expressions):
    arch = file_arch(stem)
    if arch is not None:
        return _ArchModule(stem, arch, name_expressions)
    mod = cp.RawModule(code=source(stem), options=NVRTC_OPTIONS, name_expressions=list(name_expressions) or None)
    try:
        mod.compile()
    except cp.cuda.compiler.CompileException as e:
        raise _compile_error(stem, e) from None
    return mod


# ----------------------------------------------------------------------------- prebuilt binaries
# what preparing kernels cost this process (bench/cold_start.py reads it): NVRTC compiles (or CuPy disk-cache loads of
# earlier compiles) and loads of shipped binaries (flame_core/kernels/prebuilt.py)
stats = {"nvrtc_compiles": 0, "nvrtc_seconds": 0.0, "prebuilt_loads": 0, "prebuilt_seconds": 0.0}
nvrtc_log = []     # [(stem, name expressions)] of every module that went through NVRTC
_prebuilt_by_stem = {}  # stem -> [unit dicts of the manifest] (built once)
_prebuilt_loaded = {}   # (unit name, arch) -> _PrebuiltModule
_stem_keys = {}


class _PrebuiltModule:
    """A shipped fatbin loaded for this device, used like the RawModule NVRTC makes: get_function takes a name
    expression (or an extern "C" name). Files built for an exact arch (sm_90a) hand out _ArchKernels, as
    _ArchModule does."""

    def __init__(self, raw, names, exact, stem):
        self._raw, self._names, self._exact, self._stem = raw, names, exact, stem

    def compile(self):
        pass

    def get_function(self, name):
        try:
            fn = self._raw.get_function(self._names.get(name, name))
        except Exception:  # not in the binary (a damaged or mismatched file): this kernel through NVRTC after all
            cp = backend.cupy
            exprs = (name,) if name in self._names else ()
            with _lock:
                mod = _nvrtc_module(cp, self._stem, exprs)
                stats["nvrtc_compiles"] += 1
                nvrtc_log.append((self._stem, exprs))
            return mod.get_function(name)
        return _ArchKernel(fn) if self._exact else fn


def _device_cc():
    cp = backend.cupy
    return str(cp.cuda.Device(cp.cuda.runtime.getDevice()).compute_capability)


def _prebuilt_choice(stem, name_expressions, cc):
    """(unit name, arch, file entry) of the shipped binary of `stem` that holds every expression and runs on a device
    of compute capability `cc` ("90"), or None: no manifest entry for it, no binary for this device, or the unit's
    key differs from the sources' (cuda_src edited since the build: a stale binary is never used)."""
    from . import prebuilt
    m = prebuilt.manifest()
    if not m:
        return None
    if not _prebuilt_by_stem:
        for name, u in m["units"].items():
            if isinstance(u, dict) and isinstance(u.get("files"), dict):
                _prebuilt_by_stem.setdefault(u.get("stem"), []).append((name, u))
    exact = file_arch(stem)
    for name, u in _prebuilt_by_stem.get(stem, ()):
        arch = prebuilt.arch_for(set(u["files"]), cc, exact)
        if arch is None:
            continue
        f = u["files"][arch]
        names, c_names = f.get("names") or {}, f.get("c_names") or []
        if not all(e in names or e in c_names for e in name_expressions):
            continue
        k = _stem_keys.get(stem)
        if k is None:
            k = _stem_keys[stem] = prebuilt.key(source(stem), NVRTC_OPTIONS + prebuilt.EXTRA_OPTIONS)
        return (name, arch, f) if u.get("key") == k else None
    return None


def _prebuilt_module(stem, name_expressions):
    """The shipped binary of a unit of `stem` holding every expression, loaded for this device (a _PrebuiltModule),
    or None (see _prebuilt_choice; also when the driver refuses the file: then NVRTC compiles, as without it)."""
    from . import prebuilt
    if not prebuilt.manifest():
        return None
    choice = _prebuilt_choice(stem, name_expressions, _device_cc())
    if choice is None:
        return None
    name, arch, f = choice
    mod = _prebuilt_loaded.get((name, arch))
    if mod is None:
        path, exact = str(prebuilt.DIR / f["path"]), file_arch(stem) is not None
        cp = backend.cupy
        try:
            if exact:
                raw = cp.cuda.function.Module()
                raw.load_file(path)
            else:
                raw = cp.RawModule(path=path)
                raw.compile()  # loads it now (cuModuleLoad), as NVRTC's path compiles and loads at once
        except Exception:  # a file the driver cannot load here (a damaged install, an older driver): NVRTC
            return None
        mod = _prebuilt_loaded[(name, arch)] = _PrebuiltModule(raw, f.get("names") or {}, exact, stem)
    return mod


# ----------------------------------------------------------------------------- architecture-specific files
_ARCH_LINE = re.compile(r"^//\s*arch:\s*(sm_\d+a?)\s*$", re.M)
_file_archs = {}


def file_arch(stem):
    """The exact architecture a file's `// arch: sm_90a` line asks for, or None (compiled for the device's sm_XY)."""
    if stem not in _file_archs:
        m = _ARCH_LINE.search(_read(CUDA_SRC / f"{stem}.cu"))
        _file_archs[stem] = m.group(1) if m else None
    return _file_archs[stem]


_arch_ok = {}


def arch_available(arch):
    """Whether the current CUDA device runs code built for `arch` ("sm_90a" runs on compute capability 9.0 only)."""
    cp = backend.cupy
    if cp is None or not backend.cuda_available():
        return False
    dev = cp.cuda.runtime.getDevice()
    key = (dev, arch)
    ok = _arch_ok.get(key)
    if ok is None:
        cc = cp.cuda.Device(dev).compute_capability
        ok = _arch_ok[key] = cc == arch[3:].rstrip("a")
    return ok


class _ArchKernel:
    """A kernel of an architecture-specific module, called like a cupy.RawKernel."""
    __slots__ = ("_fn", "_smem")

    def __init__(self, fn):
        self._fn = fn
        self._smem = None  # the dynamic shared memory limit, read from the driver once, then as set here

    def _attribute(self, attr):
        return backend.cupy.cuda.driver.funcGetAttribute(attr, self._fn.ptr)

    @property
    def shared_size_bytes(self):
        """Static shared memory per block (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), as cupy.RawKernel reports it."""
        return self._attribute(getattr(backend.cupy.cuda.driver, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", 1))

    @property
    def max_dynamic_shared_size_bytes(self):
        if self._smem is None:
            drv = backend.cupy.cuda.driver
            self._smem = self._attribute(drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        return self._smem

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        drv = backend.cupy.cuda.driver
        drv.funcSetAttribute(self._fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(value))
        self._smem = int(value)

    def __call__(self, grid, block, args, shared_mem=0):
        self._fn(grid, block, args, shared_mem)


class _ArchModule:
    """cuda_src/<stem>.cu compiled by NVRTC for exactly `arch` (e.g. sm_90a, which wgmma and setmaxnreg need), through
    CuPy's compile-and-cache path. CuPy (14) always targets the device's plain sm_XY, so its choice of the -arch option
    is swapped for this one compile; the disk cache key includes it."""

    def __init__(self, stem, arch, name_expressions):
        if not arch_available(arch):
            raise KernelCompileError(f"cuda_src/{stem}.cu is built for {arch} only; this device cannot run it")
        cp = backend.cupy
        from cupy._core import core
        from cupy.cuda import compiler
        num = arch[3:]
        orig = compiler._get_arch_for_options_for_nvrtc

        def arch_option(a=None):
            return (f"-arch=sm_{num}", "cubin") if a == num else orig(a)

        compiler._get_arch_for_options_for_nvrtc = arch_option
        try:
            self._mod = core.compile_with_cache(source(stem), NVRTC_OPTIONS, num, prepend_cupy_headers=False,
                                                name_expressions=list(name_expressions) or None)
        except cp.cuda.compiler.CompileException as e:
            raise _compile_error(stem, e) from None
        except (TypeError, ValueError, AttributeError) as e:  # a CuPy whose internals differ
            raise KernelCompileError(f"cannot compile cuda_src/{stem}.cu for {arch} with this CuPy: {e}") from None
        finally:
            compiler._get_arch_for_options_for_nvrtc = orig

    def compile(self):
        pass

    def get_function(self, name):
        mapping = getattr(self._mod, "mapping", None) or {}
        return _ArchKernel(self._mod.get_function(mapping.get(name, name)))


_functions = {}  # (stem, kernel_name, dtype name) -> RawKernel: the per-call lookup stays a dict hit


def get_function(stem, kernel_name, dtype=None):
    """A RawKernel: `kernel_name` from cuda_src/<stem>.cu, instantiated for `dtype` when given (cached)."""
    key = (stem, kernel_name, None if dtype is None else _dtype_names.get(dtype) or dtype_name(dtype))
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = _get_function(stem, kernel_name, dtype)
    return fn


def _get_function(stem, kernel_name, dtype):
    if dtype is None:  # extern "C": present in every compiled module of the file, so reuse one if any
        mod = next((m for (s, _), m in list(_modules.items()) if s == stem), None)
        return (mod or load_module(stem)).get_function(kernel_name)
    t = ctype(dtype)
    if "<" in kernel_name:
        expr = kernel_name.replace("{T}", t)
        return load_module(stem, (expr,)).get_function(expr)
    names = template_kernels(stem)
    expr = f"{kernel_name}<{t}>"
    if kernel_name not in names:  # declared in a way the scan does not see (a macro, ...): compile on its own
        return load_module(stem, (expr,)).get_function(expr)
    return load_module(stem, tuple(f"{n}<{t}>" for n in names)).get_function(expr)
