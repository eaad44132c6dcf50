"""One worker process of the CuPy warm-up's process pool (flame_core/kernels/cupy_warmup.py, cupy_compile_procs.py).

Run as a script (`python cupy_compile_worker.py`, never imported by FLAME) so that starting it costs an interpreter
and CuPy's import, not FLAME's, and never re-runs the user's `__main__` (what multiprocessing's spawn start method
does). It speaks JSON lines: stdin gets one init message, then one job per line; stdout answers the init with
{"ready": true, ...} or {"ready": false, "error": ...} and each job with {"ok": true/false, "s": seconds, ...}. The
end of stdin (the parent closed it, exited or died) ends the worker after the job it is on. SIGINT is ignored: a
Ctrl-C in the terminal is the parent's to handle.

The compiler named by the init message's "compiler" does the work: "cupy" is CuPy's own compile-and-cache function
(`cupy.cuda.compiler._compile_module_with_cache`) writing into the disk cache named by CUPY_CACHE_DIR, which the
parent sets to its own cache folder; "module:attr" names another factory (the tests' stand-in compilers). CuPy writes a
cache file to a temporary name and renames it into place, and checks the SHA-1 prefix of every file it loads
(cupy/cuda/_compiler_cache.py: DiskKernelCacheBackend), so the parent never loads a half-written file.

The worker never loads a module: CuPy's function loads each compiled cubin (cuModuleLoadData, which needs a CUDA
context, i.e. GPU memory), so here CuPy's `function` module is seen through a stand-in whose Module keeps the name
mapping and skips the load. The parent passes the GPU's architecture (its own `_get_arch()`), so CuPy never asks the
device either; each answer reports whether a CUDA context is current all the same ("ctx")."""
import hashlib
import importlib
import json
import os
import signal
import sys
import time


class _UnloadedModule:
    """cupy.cuda.function.Module as far as CuPy's compile-and-cache function uses it, without the load."""

    def __init__(self):
        self.mapping = None

    def load(self, cubin):
        pass

    def _set_mapping(self, mapping):
        self.mapping = mapping


class _CompileOnlyFunction:
    """Stands in for the `function` module inside cupy.cuda.compiler: Module never loads; the rest is CuPy's."""

    def __init__(self, real):
        self._real = real
        self.Module = _UnloadedModule

    def __getattr__(self, name):
        return getattr(self._real, name)


def cupy_compiler(init):
    """(compile one job, facts) through CuPy's own compile-and-cache function, after checking that this CuPy and its
    bundled headers are the parent's (the cache keys depend on both)."""
    import cupy
    from cupy._core import core
    from cupy.cuda import compiler
    header = core._get_header_source()
    if cupy.__version__ != init["cupy"]:
        raise RuntimeError(f"the worker imports CuPy {cupy.__version__}, the parent runs {init['cupy']}")
    if hashlib.sha1(header.encode()).hexdigest() != init["header_sha1"]:
        raise RuntimeError("the worker's CuPy headers differ from the parent's")
    if not callable(getattr(compiler, "_compile_module_with_cache", None)) or not hasattr(compiler, "function"):
        raise RuntimeError("this CuPy's compile path differs from the one FLAME replays")
    compiler.function = _CompileOnlyFunction(compiler.function)
    arch = init["arch"]
    try:
        from cupy_backends.cuda.api import driver
        ctx_current = driver.ctxGetCurrent
    except Exception:  # pragma: no cover - another CuPy layout; the answer then says nothing about contexts
        ctx_current = None

    def compile_one(job):
        compiler._compile_module_with_cache(
            job["source"], tuple(job["options"]), arch=arch, extra_source=header if job["headers"] else None,
            backend=job["backend"], name_expressions=job["name_expressions"], jitify=job["jitify"],
            enable_cooperative_groups=job["enable_cooperative_groups"])
        try:
            ctx = bool(ctx_current()) if ctx_current is not None else None
        except Exception:  # CUDA not even initialised in this process: no context
            ctx = False
        return {"ctx": ctx}

    return compile_one, {"cupy": cupy.__version__, "cache_dir": os.environ.get("CUPY_CACHE_DIR")}


def _factory(spec):
    if spec == "cupy":
        return cupy_compiler
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own channel
    os.dup2(2, 1)  # anything else printed (CuPy, NVRTC) goes to stderr, never into the answers

    def answer(msg):
        answers.write(json.dumps(msg) + "\n")

    line = sys.stdin.readline()
    if not line:
        return 0
    try:
        init = json.loads(line)
        compile_one, facts = _factory(init["compiler"])(init)
    except BaseException as e:  # the parent compiles in-process instead; it reports this reason
        answer({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    answer({"ready": True, "pid": os.getpid(), **facts})
    for line in sys.stdin:
        t = time.perf_counter()
        try:
            extra = compile_one(json.loads(line)) or {}
            answer({"ok": True, "s": time.perf_counter() - t, **extra})
        except Exception as e:  # a failed request is the parent's to count; its own compile reports it
            answer({"ok": False, "s": time.perf_counter() - t, "error": f"{type(e).__name__}: {e}"[:2000]})
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # no sibling module shadows another
    sys.exit(main())
