"""Finds `cuda_src/*.cu`, compiles them lazily with `cupy.RawModule` (NVRTC) and launches their kernels.

API (what kernel families and other helpers call)
-------------------------------------------------
``enabled()``
    True when raw kernels should run: CuPy imports, a GPU is visible, ``FLAME_KERNELS`` is not ``0`` (read at every
    call) and no ``reference()`` block is active. Families take the NumPy/CuPy reference path otherwise.
``reference()``
    Context manager forcing the reference path (this thread) - for A/B checks of a kernel against its oracle.
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
``launch(kernel, grid, block, args, shared_mem=0, stream=None)``
    Launches; ints in ``grid``/``block`` become 1-tuples; dynamic shared memory over 48 KiB is opted into.
``compute_capability()``
    The current device's compute capability as an int (90 for sm_90).
``cdiv(a, b)``, ``grid_1d(n, block)``
    Ceiling division and the 1-D grid covering ``n`` items.
``ctype(dtype)``
    The CUDA C type name for an array dtype (raises DTypeError for the unsupported ones).

Compilation
-----------
``#include "x.cuh"`` lines naming files in cuda_src are inlined here, each wrapped in ``#line`` directives, so that
NVRTC reports errors against the real file and line, and so that CuPy's disk cache (``CUPY_CACHE_DIR``, keyed on
the full source, options and name expressions) sees header edits. Every ``template <typename T> __global__`` kernel of a
file is instantiated at once for a dtype: one NVRTC compile per (file, dtype). Templates with more parameters (or
declared through macros) compile per expression. Compile errors raise ``flame_core.errors.KernelCompileError``
naming the file and line.
"""
import contextlib
import ctypes
import os
import re
import threading
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import backend
from ..errors import DTypeError, KernelCompileError

# FLAME_CUDA_SRC overrides; else the copy a wheel ships (flame_core/cuda_src), else the source tree's cuda_src/
_PKG = Path(__file__).resolve().parents[1]
CUDA_SRC = Path(os.environ.get("FLAME_CUDA_SRC") or next(
    (p for p in (_PKG / "cuda_src", _PKG.parent / "cuda_src") if p.is_dir()), _PKG.parent / "cuda_src"))
NVRTC_OPTIONS = ("--std=c++17",)

_local = threading.local()
_lock = threading.Lock()
_modules = {}     # (stem, name_expressions) -> RawModule
_sources = {}     # stem -> expanded source text

_CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double"}
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*(?://[^\n]*)?$', re.M)  # a trailing // comment allowed
_TEMPLATE_KERNEL = re.compile(
    r"template\s*<\s*typename\s+\w+\s*>\s*__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_ERROR_LINE = re.compile(r'^(?:"?([^"(\s]+)"?)\((\d+)\): (error|warning|catastrophic error)', re.M)


# ----------------------------------------------------------------------------- switches
# FLAME_KERNELS is read at every call, straight from os.environ's backing dict (os.environ.get encodes the key and
# decodes the value each time: most of a microsecond on the per-op path); the parsed flag is cached per raw value.
_env_data = getattr(os.environ, "_data", None)
try:
    _KERNELS_KEY = os.environ.encodekey("FLAME_KERNELS")
except Exception:  # pragma: no cover - a platform whose os.environ lacks the helpers
    _env_data = None
_flag_of = {}


def _kernels_flag():
    if _env_data is None:  # pragma: no cover
        return backend.env_flag("FLAME_KERNELS", True)
    raw = _env_data.get(_KERNELS_KEY)
    if raw is None:
        return True
    f = _flag_of.get(raw)
    if f is None:
        f = _flag_of[raw] = backend.env_flag("FLAME_KERNELS", True)
    return f


def enabled():
    """Whether raw kernels run (CuPy + GPU present, FLAME_KERNELS != 0, no `reference()` block)."""
    if getattr(_local, "force_reference", 0):
        return False
    if not _kernels_flag():
        return False
    return backend.cuda_available()


@contextlib.contextmanager
def reference():
    """Run the NumPy/CuPy reference implementations inside this block (this thread only)."""
    _local.force_reference = getattr(_local, "force_reference", 0) + 1
    try:
        yield
    finally:
        _local.force_reference -= 1


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


# ----------------------------------------------------------------------------- sizes
def cdiv(a, b):
    return -(-int(a) // int(b))


def grid_1d(n, block):
    return (max(1, cdiv(n, block)),)


def ctype(dtype):
    name = dtype_name(dtype)
    try:
        return _CTYPES[name]
    except KeyError:
        raise DTypeError(f"no CUDA kernel type for dtype {name} (kernels take float32, float16, bfloat16)") from None


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
            arch = file_arch(stem)
            if arch is not None:
                mod = _ArchModule(stem, arch, name_expressions)
            else:
                mod = cp.RawModule(code=source(stem), options=NVRTC_OPTIONS,
                                   name_expressions=list(name_expressions) or None)
                try:
                    mod.compile()
                except cp.cuda.compiler.CompileException as e:
                    raise _compile_error(stem, e) from None
            _modules[key] = mod
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
        from cupy.cuda import compiler
        from cupy._core import core
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


# ----------------------------------------------------------------------------- launch
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
    if stream is not None:
        with stream:
            kernel(grid, block, args, shared_mem=shared_mem)
    else:
        kernel(grid, block, args, shared_mem=shared_mem)


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


_cc = {}  # device -> compute capability as an int


def compute_capability():
    """The current CUDA device's compute capability as an int (90 for sm_90)."""
    cp = backend.cupy
    dev = cp.cuda.runtime.getDevice()
    cc = _cc.get(dev)
    if cc is None:
        cc = _cc[dev] = int(cp.cuda.Device(dev).compute_capability)
    return cc


def launch_dependent(kernel, grid, block, args, shared_mem=0):
    """Launch `kernel` as a programmatic dependent of the kernel before it in the stream (sm_90; cuLaunchKernelEx with
    programmatic stream serialization): its blocks may start while that kernel still runs (from when every block of
    it has executed grid_dependents_launch), so the launch latency overlaps the earlier kernel's tail. The kernel
    must call grid_dependency_wait (common.cuh) before it reads the earlier kernel's output. Falls back to `launch`
    before sm_90, without cuLaunchKernelEx, and while a CUDA graph is being captured."""
    stream = backend.cupy.cuda.get_current_stream()
    if _cu_launch_ex() is None or compute_capability() < 90 or (stream.ptr and stream.is_capturing()):
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
    dependent: launched as a programmatic dependent of the stream's previous kernel (see launch_dependent, which
    checks that the device and driver allow it)."""
    __slots__ = ("_fn", "_grid", "_block", "_smem", "_vals", "_ptrs", "_cv", "_slots", "_pa", "_dep")

    def __init__(self, kernel, grid, block, args, n_pointers, shared_mem=0, dependent=False):
        self._fn = _driver_function(kernel).ptr
        self._dep = dependent
        grid, block = _dims(grid), _dims(block)
        self._grid, self._block = grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block))
        self._smem = int(shared_mem)
        self._vals = np.zeros(len(args), dtype=np.uint64)  # one 8-byte slot per argument, value in its low bytes
        raw = self._vals.view(np.uint8)
        for i, a in enumerate(args):
            if a is None:  # a dynamic slot
                continue
            if backend.is_cuda_array(a):
                self._vals[i] = a.data.ptr
            else:
                b = np.asarray(a).tobytes()
                raw[8 * i:8 * i + len(b)] = np.frombuffer(b, dtype=np.uint8)
        self._ptrs = self._vals.ctypes.data + 8 * np.arange(len(args), dtype=np.uint64)
        # a ctypes view of the slots (cheaper to write than a NumPy slice) and the parameter array's address, read
        # once (`ndarray.ctypes` costs over a microsecond per access)
        self._cv = (ctypes.c_uint64 * len(args)).from_address(self._vals.ctypes.data)
        self._pa = int(self._ptrs.ctypes.data)
        self._slots = tuple(range(n_pointers)) if type(n_pointers) is int else tuple(int(i) for i in n_pointers)

    def __call__(self, values):
        """Launch with these raw 8-byte values (ints, one per dynamic slot, in order) in the dynamic slots: a device
        address, or a scalar's bit pattern in the low bytes (`f32_bits(v)` for a `float` parameter)."""
        global launches
        launches += 1
        cv = self._cv
        for i, v in zip(self._slots, values):
            cv[i] = v
        g, b = self._grid, self._block
        cuda = backend.cupy.cuda
        if self._dep:
            attr = _LaunchAttribute()
            attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value[0] = 1
            cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], self._smem, cuda.get_current_stream().ptr,
                                ctypes.pointer(attr), 1)
            err = _cu_launch_ex()(ctypes.byref(cfg), self._fn, self._pa, None)
            if err:
                raise cuda.driver.CUDADriverError(err)
            return
        cuda.driver.launchKernel(self._fn, g[0], g[1], g[2], b[0], b[1], b[2], self._smem,
                                 cuda.get_current_stream().ptr, self._pa, 0)

    launch_raw = __call__


# ----------------------------------------------------------------------------- shared helpers of the families
def xp_of(a):
    return backend.xp_of(a)


def compute_dtype(dtype):
    """The dtype references compute in: float64 stays, everything else runs in float32 (as the kernels do)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def contiguous(a):
    """C-contiguous and, on the GPU, 16-byte aligned (kernels read 16-byte vectors when the base address allows it;
    a copy is cheaper than the scalar path for the large arrays that matter)."""
    if not a.flags.c_contiguous:
        return backend.xp_of(a).ascontiguousarray(a)
    if backend.is_cuda_array(a) and a.data.ptr % 16:
        return a.copy()
    return a


def vec_width(dtype):
    """Elements in a 16-byte vector of this dtype."""
    return 16 // np.dtype(dtype).itemsize


_sm_count = {}


def sm_count():
    cp = backend.cupy
    dev = cp.cuda.runtime.getDevice()
    n = _sm_count.get(dev)
    if n is None:
        n = _sm_count[dev] = cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return n


MAX_VPT = 4  # keep equal to MAX_VPT in cuda_src/common.cuh
VPTS = (1, 2, 4)  # row kernels exist per vectors-per-thread: <name>1, <name>2, <name>4
vpt_override = None  # benchmarks set this to sweep the choice; None: the heuristic of row_plan


def row_tpr(nvec, vpt):
    """Threads per row for `nvec` vectors at `vpt` each: a power of two up to 32 (shuffle groups), else a multiple
    of 32 (the whole block)."""
    need = cdiv(nvec, vpt)
    if need <= 32:
        tpr = 1
        while tpr < need:
            tpr *= 2
        return tpr
    return cdiv(need, 32) * 32


def row_plan(stem, name, dtype, rows, cols, vec):
    """(kernel, grid, block, tpr) for a row-kernel family `<name>1`, `<name>2`, `<name>4` of cuda_src/<stem>.cu
    (the digit: vectors of `vec` elements each thread caches in registers).

    The smallest count that keeps a row within 256 threads (else 4), raised while the kernel's registers do not
    allow that many threads per block. Rows wider than tpr * vpt vectors run the kernel's looping path."""
    nvec = max(1, cols // vec)
    if vpt_override is not None:
        order = [vpt_override]
    else:
        first = next((v for v in VPTS if cdiv(nvec, v) <= 256), VPTS[-1])
        order = [v for v in VPTS if v >= first]
    for vpt in order:
        kernel = get_function(stem, f"{name}{vpt}", dtype)
        limit = kernel.max_threads_per_block // 32 * 32
        tpr = row_tpr(nvec, vpt)
        if tpr <= limit:
            break
    else:
        tpr = min(limit, 1024)  # looping path
    block = tpr if tpr > 32 else 128
    return kernel, (max(1, cdiv(rows, block // tpr)),), (block,), tpr


def resident_blocks(kernel, block_threads):
    """How many blocks of this kernel fit on the whole GPU at once (registers, threads, static shared memory)."""
    per_sm = min(65536 // (max(1, kernel.num_regs) * block_threads), 2048 // block_threads, 32)
    if kernel.shared_size_bytes:
        per_sm = min(per_sm, (227 * 1024) // kernel.shared_size_bytes)
    return max(1, per_sm) * sm_count()


def elementwise_grid(n, dtype, block=256):
    """Grid for the grid-stride elementwise kernels over n elements read as 16-byte vectors."""
    return (max(1, min(cdiv(cdiv(n, vec_width(dtype)), block), sm_count() * 16)),), (block,)


def f32(v):
    return np.float32(v)


def i32(v):
    v = int(v)
    if not -2 ** 31 <= v < 2 ** 31:
        raise ValueError(f"kernel argument {v} does not fit in int32")
    return np.int32(v)


def i64(v):
    return np.int64(v)


def null():
    """A null pointer argument."""
    return np.uint64(0)


column_sum_rows = 32  # threads per column in column_sum's blocks of (32, column_sum_rows) (1 .. 32)
# The 16-byte form (common.cuh, column_sum_vec4) where cols % 4 == 0: blocks of (4, column_sum_vec_rows), 16 columns
# each (a multiple of 8, <= 256). 0: always the scalar form. By default ("auto") only where the scalar form's blocks
# (1024 threads at 40 registers: one per SM) would not all fit at once (LayerNorm's two batches of 3072 columns:
# 192 blocks on 132 SMs; bench/kernel_sweep.py csum / plan: 0.0390-0.0403 -> 0.0376-0.0390 ms for the whole
# backward); "always" for the tests.
column_sum_vec_rows = 128
column_sum_vec_when = "auto"


def column_sum(stem, kernel, part, out_dtype, dependent=False):
    """Deterministic sums over axis -2 of fp32 partial rows: (parts, cols) -> (cols,) or (B, parts, cols) -> (B, cols),
    by `kernel` (a `column_sum_body` wrapper in cuda_src/<stem>.cu), in out_dtype. dependent: launched as a
    programmatic dependent of the kernel that wrote `part` (launch_dependent), which must be the stream's last."""
    xp = backend.xp_of(part)
    batches = part.shape[0] if part.ndim == 3 else 1
    parts, cols = part.shape[-2:]
    kdt = out_dtype if dtype_name(out_dtype) in ("float32", "float16", "bfloat16") else np.float32
    out = xp.empty(part.shape[:-2] + (cols,), dtype=kdt)
    wide = column_sum_vec_when == "always" or cdiv(cols, 32) * batches > sm_count()
    if column_sum_vec_rows and wide and cols % 4 == 0 and part.data.ptr % 16 == 0:
        grid, block = (cdiv(cols, 16), batches), (4, column_sum_vec_rows)
    else:
        grid, block = (cdiv(cols, 32), batches), (32, column_sum_rows)
    (launch_dependent if dependent else launch)(get_function(stem, kernel, kdt), grid, block,
                                                (part, out, i32(parts), i32(cols)))
    return out.astype(out_dtype, copy=False)


_counters = {}  # (device, stream) -> zeroed uint32 counters of the single-launch column sums


def reduction_counters(n):
    """A uint32 device buffer of >= n zeroed counters for kernels that sum their partial rows in the same launch
    (common.cuh, last_arrival: the last block to arrive resets each counter it used, so the buffer is zero again when
    the kernel ends). Eager launches share one persistent buffer per (device, stream): launches on one stream run in
    order, and concurrent streams get their own. While a CUDA graph is being captured: a fresh buffer from the pool
    (the graph's private memory) zeroed by an async memset, captured with the kernel and replayed before it."""
    cp = backend.cupy
    s = cp.cuda.get_current_stream()
    if s.ptr and s.is_capturing():
        buf = cp.empty((max(1, n),), dtype=np.uint32)
        cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, s.ptr)
        return buf
    key = (cp.cuda.runtime.getDevice(), s.ptr)
    buf = _counters.get(key)
    if buf is None or buf.size < n:
        buf = _counters[key] = cp.zeros((max(1024, n),), dtype=np.uint32)  # zeroed in order on this stream
    return buf


# ----------------------------------------------------------------------------- warming the disk cache
def _compile_one(stem, dtype_name):
    import time
    t = time.perf_counter()
    try:
        names = template_kernels(stem)
        if dtype_name is None or not names:
            load_module(stem)
        else:
            get_function(stem, names[0], np.dtype(dtype_name) if dtype_name != "bfloat16" else _bf16())
        err = None
    except Exception as e:  # reported, not raised: one broken file must not stop the others
        err = f"{type(e).__name__}: {str(e)[:2000]}"
    return stem, dtype_name, time.perf_counter() - t, err


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


_DTYPES_LINE = re.compile(r"^//\s*dtypes:\s*([\w ,]+)$", re.M)


def _file_dtypes(stem, dtypes):
    """The dtypes a file's templates are instantiated for: a `// dtypes: float16, bfloat16` line limits them."""
    m = _DTYPES_LINE.search(_read(CUDA_SRC / f"{stem}.cu"))
    if m is None:
        return dtypes
    allowed = {d.strip() for d in m.group(1).split(",")}
    return tuple(d for d in dtypes if d in allowed)


def precompile(stems=None, dtypes=("float32", "float16", "bfloat16"), processes=8):
    """Compile every (file, dtype) module in parallel processes so that CuPy's disk cache holds them; later
    `get_function` calls in any process then load instead of compiling. Returns [(stem, dtype, seconds, error)].
    Command line: python3 -m flame_core.kernels.loader [stem ...]"""
    import concurrent.futures
    import multiprocessing
    stems = stems or sorted(p.stem for p in CUDA_SRC.glob("*.cu")
                            if file_arch(p.stem) is None or arch_available(file_arch(p.stem)))
    jobs = [(s, d) for s in stems for d in (_file_dtypes(s, dtypes) if template_kernels(s) else (None,))]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        return list(pool.map(_compile_one, *zip(*jobs)))


def f32_bits(v):
    """The bit pattern of float32(v) as an int: the raw slot value of a `float` kernel parameter (PackedLaunch)."""
    return int(np.float32(v).view(np.uint32))


if __name__ == "__main__":
    import sys
    from flame_core.kernels import loader as _loader  # workers must unpickle the importable module's function
    for stem_, dt_, sec_, err_ in _loader.precompile(sys.argv[1:] or None):
        print(f"{stem_:24s} {str(dt_):10s} {sec_:6.2f} s  {err_ or 'ok'}", flush=True)
