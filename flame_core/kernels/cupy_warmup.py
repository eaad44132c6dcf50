"""CuPy's own kernels ready without a compile wait: replaying a recorded list of CuPy's compiles on a thread pool.

FLAME's kernels load from shipped binaries (`prebuilt`), but CuPy's own (ufuncs, reductions, `astype`, copies, ...)
compile through NVRTC on first use into CuPy's disk cache: on an H200 the demo's first steps waited 23.9 s for 95 of
them (BENCHMARKS.md, "Cold start"). CuPy generates each kernel's source from the op, the dtypes and the arrays' layout
(dimensions after merging, contiguity, index width), so no version-independent (op, dtype) list names them without
CuPy's internals, and running the ops on a side thread would allocate from FLAME's pool and launch work behind the
user's back. What is stable is the compile request itself: a *manifest* records the exact requests CuPy made in a
recorded run (source, options, name expressions; `FLAME_CUPY_KERNELS_RECORD=PATH` or `bench/cold_start.py
--record-cupy-kernels`), and at the first use of a `cuda` device (`flame_core.device`) a pool replays them through
CuPy's own compile-and-cache function, in the recorded order, while the model loads. The pool's threads each drive a
worker process (cupy_compile_procs.py: one process's compiles serialise -- on the H200 94 compiles took 117 s summed
on 8 threads against 24.8 s one at a time -- while processes have an NVRTC each) that writes into this process's CuPy
disk cache; or, with FLAME_CUPY_WARMUP_PROCESSES=0, compile in this process (NVRTC releases the GIL while it
compiles). When the process then asks for a kernel, CuPy finds it in its cache; a request still compiling on the pool
is waited for rather than compiled twice, and one still queued is taken off the queue and compiled by the caller.

Results cannot change: the pool compiles exactly what CuPy would (same source and options, so the same cache key and
binary), and nothing runs on the GPU (a worker process has no CUDA context). A manifest is used only by the CuPy
version that recorded it with the same bundled headers; with any other, or none (`cupy_kernels/cupy-<version>.json.gz`),
nothing is replayed and CuPy compiles on demand as before. A request that no longer matches costs only CPU time. At
exit the pool takes no new request; a thread compiling in this process finishes first (an exit can wait for it), a
worker process finishes its request on its own while the process exits.

A warm-up whose every request compiled (on the pool, or by the process that took it back; none failed) leaves a
marker file in CuPy's cache folder, named by the CuPy version, its headers, the GPU architecture, the NVRTC version and
the requests (`marker_path`); a later process that finds it starts no pool: on a machine whose cache is already warm,
no worker processes are started at every run. Deleting the cache folder deletes the marker with it; a kernel missing
from a cache that still holds the marker is compiled on first use, as without the warm-up.

Environment: ``FLAME_CUPY_WARMUP=0`` turns the warm-up off; ``FLAME_CUPY_WARMUP_PROCESSES=n`` runs n worker
processes, ``=0`` the thread pool, which ``FLAME_CUPY_WARMUP_THREADS=n`` sizes (set alone, it selects the thread pool);
by default DEFAULT_POOL ("processes") of the CPUs this process may run on less one, at most 8 (`pool_kind`; each
compile holds a CPU and NVRTC's working memory while it runs, and a worker process an interpreter with CuPy besides);
``FLAME_CUPY_KERNELS_RECORD=PATH`` records this process's CuPy compile requests into PATH at exit (merged with what the
file holds for the same CuPy version). ``stats`` counts what the warm-up did (bench/cold_start.py reads it).
"""
import gzip
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from .. import backend

FORMAT = 1
DIR = Path(__file__).resolve().parent / "cupy_kernels"
MAX_THREADS = 8
DEFAULT_POOL = "processes"  # or "threads"; FLAME_CUPY_WARMUP_PROCESSES overrides (pool_kind)

stats = {"pool": None, "threads": 0, "entries": 0, "compiled": 0, "failed": 0, "taken": 0, "taken_ok": 0,
         "taken_failed": 0, "waits": 0,
         "wait_seconds": 0.0, "pool_seconds": 0.0, "started": None, "finished": None, "reason": "not started"}

_state_lock = threading.Lock()
_pool = None       # the running WarmPool (None: none started)
_started = False   # start() ran once in this process (whatever it decided)
_recorder = None   # the Recorder while one is active
_orig = None       # CuPy's _compile_module_with_cache, once the hook is installed


def enabled():
    """False when FLAME_CUPY_WARMUP is 0 / false / no / off."""
    return backend.env_flag("FLAME_CUPY_WARMUP", True)


def default_size(cores=None):
    """The CPUs this process may run on less one (at least 1, at most 8): each compile holds one CPU and NVRTC's
    working memory while it runs, and the process itself keeps going meanwhile."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores - 1))


def num_threads(cores=None):
    """The thread pool's size: FLAME_CUPY_WARMUP_THREADS, else default_size()."""
    n = backend.env_positive_int("FLAME_CUPY_WARMUP_THREADS")
    return default_size(cores) if n is None else n


def pool_kind(cores=None):
    """("processes", n) or ("threads", n): what the warm-up compiles on. FLAME_CUPY_WARMUP_PROCESSES=n (n > 0) asks
    for n worker processes, =0 for the thread pool (sized by FLAME_CUPY_WARMUP_THREADS, else default_size()).
    Unset: FLAME_CUPY_WARMUP_THREADS alone asks for the thread pool as it always did; with neither, DEFAULT_POOL of
    default_size(). Both set, with processes: ValueError (one of them would be ignored)."""
    raw = os.environ.get("FLAME_CUPY_WARMUP_PROCESSES")
    procs = None
    if raw is not None and raw.strip():
        try:
            procs = int(raw)
        except ValueError:
            procs = -1
        if procs < 0:
            raise ValueError(f"FLAME_CUPY_WARMUP_PROCESSES must be 0 (threads) or a positive integer, got {raw!r}")
    threads = backend.env_positive_int("FLAME_CUPY_WARMUP_THREADS")
    if procs == 0 or (procs is None and (threads is not None or DEFAULT_POOL == "threads")):
        return "threads", num_threads(cores)
    if threads is not None:
        raise ValueError(f"FLAME_CUPY_WARMUP_PROCESSES={raw} and FLAME_CUPY_WARMUP_THREADS={threads}: set one "
                         f"(FLAME_CUPY_WARMUP_PROCESSES=0 selects the thread pool)")
    return "processes", default_size(cores) if procs is None else procs


def manifest_path(cupy_version):
    return DIR / f"cupy-{cupy_version}.json.gz"


# ------------------------------------------------------------------ requests, as CuPy makes them and as stored
def request_key(source, options, kw):
    """What identifies a compile request of CuPy's _compile_module_with_cache (all that enters its cache key, less
    the bundled headers, which one process holds once)."""
    ne = kw.get("name_expressions")
    return (source, tuple(options), kw.get("arch"), kw.get("backend", "nvrtc"), None if ne is None else tuple(ne),
            bool(kw.get("jitify", False)), bool(kw.get("enable_cooperative_groups", False)),
            bool(kw.get("to_ltoir", False)))


def normalize_options(options, ref):
    """Options with the machine's paths taken out: an option equal to one of `ref` (what CuPy adds to every compile
    here: its header and CUDA include folders, the C++ standard) is stored as {"ref": index}."""
    pos = {o: i for i, o in enumerate(ref)}
    return [{"ref": pos[o]} if o in pos else o for o in options]


def expand_options(stored, ref):
    """The inverse of normalize_options with this machine's `ref`; None when a reference points past it."""
    out = []
    for o in stored:
        if isinstance(o, dict):
            i = o.get("ref")
            if not isinstance(i, int) or not 0 <= i < len(ref):
                return None
            out.append(ref[i])
        else:
            out.append(o)
    return tuple(out)


def header_sha1(header_source):
    return hashlib.sha1(header_source.encode()).hexdigest()


def read_manifest(path, cupy_version, header_sha):
    """The entries of the manifest at `path` when it was recorded by this CuPy version with these headers, else
    (None, why)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, f"no manifest for CuPy {cupy_version} ({path.name})"
    except (OSError, ValueError) as e:
        return None, f"unreadable manifest {path}: {e}"
    if data.get("format") != FORMAT:
        return None, f"manifest format {data.get('format')} (this FLAME reads {FORMAT})"
    if data.get("cupy") != cupy_version:
        return None, f"manifest recorded with CuPy {data.get('cupy')}, this is {cupy_version}"
    if data.get("header_sha1") != header_sha:
        return None, "CuPy's bundled headers differ from the recording's"
    return list(data.get("entries", [])), None


def write_manifest(path, cupy_version, header_sha, entries, info=None):
    """Write (merge into) the manifest at `path`: entries already there for the same CuPy version and headers keep
    their place, new ones follow in the order given. Returns the number of entries written."""
    from ..io import atomic_write
    old, _ = read_manifest(Path(path), cupy_version, header_sha)
    merged, seen = [], set()
    for e in (old or []) + list(entries):
        k = json.dumps(e, sort_keys=True)
        if k not in seen:
            seen.add(k)
            merged.append(e)
    data = {"format": FORMAT, "cupy": cupy_version, "header_sha1": header_sha, "recorded": info or {},
            "entries": merged}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, "wb") as f:
        f.write(gzip.compress(json.dumps(data, indent=0).encode(), mtime=0))
    return len(merged)


class Recorder:
    """Collects CuPy's compile requests, in order, once each, as manifest entries. FLAME's own modules (the loader's
    NVRTC fallback) are left out: they have shipped binaries, and their sources are FLAME's to prepare."""

    def __init__(self, ref, header_source):
        self.ref, self.header = tuple(ref), header_source
        self.entries, self._seen, self._lock = [], set(), threading.Lock()

    def note(self, source, options, kw):
        extra = kw.get("extra_source")
        if kw.get("log_stream") is not None or kw.get("to_ltoir") or kw.get("arch") is not None:
            return
        if extra is not None and extra is not self.header and extra != self.header:
            return
        key = request_key(source, options, kw)
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            ne = kw.get("name_expressions")
            self.entries.append({"source": source, "options": normalize_options(options, self.ref),
                                 "backend": kw.get("backend", "nvrtc"),
                                 "name_expressions": None if ne is None else list(ne),
                                 "jitify": bool(kw.get("jitify", False)),
                                 "enable_cooperative_groups": bool(kw.get("enable_cooperative_groups", False)),
                                 "extra_source": None if extra is None else "headers"})


# ----------------------------------------------------------------------------- the pool
_QUEUED, _RUNNING, _DONE, _TAKEN = range(4)


class _Job:
    __slots__ = ("key", "payload", "state", "done")

    def __init__(self, key, payload):
        self.key, self.payload, self.state, self.done = key, payload, _QUEUED, threading.Event()


class WarmPool:
    """Compiles `jobs` ([(key, payload)], in order, the first of equal keys kept) with `compile_fn(payload)` on
    `threads` threads (each runs `thread_init()` first and `thread_exit()` last). `claim(key)` is what a caller does
    before compiling `key` itself: a queued job leaves the queue (the caller compiles it), a running one is waited
    for; either way the caller then compiles or finds the result in the cache. A failing compile is counted, never
    raised: the caller's own compile reports it. Workers stop taking jobs once the main thread has finished (the
    interpreter is exiting) or `stop()` was called."""

    def __init__(self, jobs, compile_fn, threads, thread_init=None, counters=None, thread_exit=None, on_done=None):
        self._compile, self._init, self._exit = compile_fn, thread_init, thread_exit
        self._on_done = on_done  # called once with the stats when every job is compiled: on the pool, or by the
        self._done_called = False  # process that took it back (`taken_done`)
        self.stats = counters if counters is not None else dict(stats)
        self._jobs, self._order = {}, []
        for key, payload in jobs:
            if key not in self._jobs:
                self._jobs[key] = job = _Job(key, payload)
                self._order.append(job)
        self.stats.update(entries=len(self._order), compiled=0, failed=0, taken=0, taken_ok=0, taken_failed=0,
                          waits=0, wait_seconds=0.0,
                          pool_seconds=0.0, started=time.perf_counter(), finished=None, reason="running")
        self._lock = threading.Lock()
        self._next = 0
        self._stop = False
        self._local = threading.local()
        self._live = max(1, min(int(threads), len(self._order))) if self._order else 0
        self.stats["threads"] = self._live
        self.threads = [threading.Thread(target=self._work, name=f"flame-cupy-warmup-{i}", daemon=False)
                        for i in range(self._live)]
        if not self._order:
            self._finish("nothing to compile")
        for t in self.threads:
            t.start()

    def is_worker(self):
        return getattr(self._local, "worker", False)

    def _take(self):
        with self._lock:
            while not self._stop and self._next < len(self._order):
                job = self._order[self._next]
                self._next += 1
                if job.state == _QUEUED:
                    job.state = _RUNNING
                    return job
            return None

    def _work(self):
        self._local.worker = True
        try:
            if self._init is not None:
                self._init()
        except Exception:  # a thread that cannot set up compiles nothing; the callers compile on demand
            self._stop = True
        try:
            self._jobs_loop()
        finally:
            if self._exit is not None:
                self._exit()
        with self._lock:
            self._live -= 1
            last = self._live == 0
        if last:
            self._finish("stopped" if self._stop or not threading.main_thread().is_alive() else "done")

    def _jobs_loop(self):
        main = threading.main_thread()
        while main.is_alive():
            job = self._take()
            if job is None:
                break
            t = time.perf_counter()
            try:
                self._compile(job.payload)
                ok = True
            except Exception:  # the caller's own compile raises it (with CuPy's message) if it matters
                ok = False
            with self._lock:
                self.stats["pool_seconds"] += time.perf_counter() - t
                self.stats["compiled" if ok else "failed"] += 1
                job.state = _DONE
            job.done.set()

    def _finish(self, reason):
        self.stats["finished"] = time.perf_counter()
        self.stats["reason"] = reason
        self._maybe_done()

    def _maybe_done(self):
        """Call on_done once, when the pool has finished ("done") and every job it did not compile itself was
        compiled by the process that took it back; none failed."""
        st = self.stats
        with self._lock:
            if (self._done_called or self._on_done is None or st["reason"] != "done" or st["failed"]
                    or st["taken_failed"] or st["compiled"] + st["taken_ok"] != st["entries"]):
                return
            self._done_called = True
        try:
            self._on_done(st)
        except Exception:  # (a marker that cannot be written: the next process replays the manifest again)
            pass

    def taken_done(self, ok):
        """The process finished compiling a job it took back (`claim` returned True): `ok` whether it compiled."""
        with self._lock:
            self.stats["taken_ok" if ok else "taken_failed"] += 1
        self._maybe_done()

    def claim(self, key):
        """True when the caller took a queued job back (it compiles it, then calls `taken_done`); else the job is
        done, unknown, or was running and has been waited for."""
        job = self._jobs.get(key)
        if job is None:
            return False
        with self._lock:
            if job.state == _QUEUED:
                job.state = _TAKEN
                self.stats["taken"] += 1
                return True
            if job.state != _RUNNING:
                return False
        t = time.perf_counter()
        job.done.wait()
        with self._lock:
            self.stats["waits"] += 1
            self.stats["wait_seconds"] += time.perf_counter() - t
        return False

    def stop(self):
        """Take no further jobs (the running ones finish)."""
        self._stop = True

    def join(self, timeout=None):
        for t in self.threads:
            t.join(timeout)


# ----------------------------------------------------------------------------- CuPy's side
def _cupy_parts():
    """(compiler module, core module, version string, header source, reference options), or None where this CuPy
    lacks what the warm-up uses (then it does nothing)."""
    cp = backend.cupy
    try:
        from cupy._core import core
        from cupy.cuda import compiler
        if cp.cuda.runtime.is_hip or not callable(getattr(compiler, "_compile_module_with_cache", None)):
            return None
        return compiler, core, cp.__version__, core._get_header_source(), tuple(core.assemble_cupy_compiler_options(()))
    except Exception:  # another CuPy layout (or no CUDA headers): nothing to replay
        return None


def _flame_module_compile():
    """True inside FLAME's loader compiling one of its own modules (kept out of the manifest)."""
    from . import loader
    codes = {loader._nvrtc_module.__code__, loader._ArchModule.__init__.__code__}
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in codes:
            return True
        f = f.f_back
    return False


def _hooked(source, options=(), *args, **kw):
    """CuPy's _compile_module_with_cache behind FLAME's hook: records the request while a Recorder runs, and claims
    it from the warm-up pool (waiting if it is compiling there) before CuPy compiles it or loads it from its cache.
    A call in another form than CuPy 14's (more positional arguments) passes straight through."""
    if not args:
        rec = _recorder
        if rec is not None and not _flame_module_compile():
            rec.note(source, options, kw)
        pool = _pool
        if pool is not None and not pool.is_worker() and pool.claim(request_key(source, options, kw)):
            ok = False
            try:
                out = _orig(source, options, **kw)
                ok = True
                return out
            finally:
                pool.taken_done(ok)
    return _orig(source, options, *args, **kw)


def install_hook():
    """Put _hooked in front of CuPy's _compile_module_with_cache (once). False where CuPy is absent or differs."""
    global _orig
    with _state_lock:
        if _orig is not None:
            return True
        parts = _cupy_parts() if backend.cupy is not None else None
        if parts is None:
            return False
        compiler = parts[0]
        _orig = compiler._compile_module_with_cache
        compiler._compile_module_with_cache = _hooked
        return True


def record(path=None):
    """Start recording CuPy's compile requests; returns a function that writes them into `path` (default: the
    shipped manifest of this CuPy version) and returns the entry count. None without CuPy (or with a CuPy whose
    internals differ)."""
    global _recorder
    parts = _cupy_parts() if backend.cupy is not None else None
    if parts is None or not install_hook():
        return None
    _, _, version, header, ref = parts
    rec = _recorder = Recorder(ref, header)
    target = Path(path) if path else manifest_path(version)

    def write():
        info = {"python": sys.version.split()[0]}
        try:
            info["nvrtc"] = list(backend.cupy.cuda.nvrtc.getVersion())
            info["cuda_build"] = backend.cupy.cuda.driver.get_build_version()
        except Exception:  # informational only
            pass
        return write_manifest(target, version, header_sha1(header), rec.entries, info)
    return write


def replay_jobs(entries, header, ref):
    """[(request key, (source, options, keyword arguments))]: the manifest's entries as CuPy's compile-and-cache
    function takes them on this machine (its header source and reference options); entries that do not fit are
    left out."""
    jobs = []
    for e in entries:
        options = expand_options(e.get("options", []), ref)
        if options is None or e.get("extra_source") not in (None, "headers"):
            continue
        kw = {"backend": e.get("backend", "nvrtc"), "name_expressions": e.get("name_expressions"),
              "jitify": e.get("jitify", False), "enable_cooperative_groups": e.get("enable_cooperative_groups", False),
              "extra_source": header if e.get("extra_source") == "headers" else None}
        jobs.append((request_key(e["source"], options, kw), (e["source"], options, kw)))
    return jobs


def start(device_index=0):
    """Start the warm-up for the GPU `device_index` (once per process; later calls return the same pool). None on
    the CPU, without CuPy, with FLAME_CUPY_WARMUP=0 or without a manifest for this CuPy (stats["reason"] says why)."""
    global _pool, _started
    with _state_lock:
        if _started:
            return _pool
        _started = True
    rec_path = os.environ.get("FLAME_CUPY_KERNELS_RECORD")
    if rec_path and backend.cupy is not None and backend.cuda_available():
        writer = record(rec_path)
        if writer is not None:
            import atexit
            atexit.register(writer)
    if not enabled():
        stats["reason"] = "off (FLAME_CUPY_WARMUP=0)"
        return None
    if backend.cupy is None or not backend.cuda_available():
        stats["reason"] = "no GPU"
        return None
    if backend.env_flag("CUPY_CACHE_IN_MEMORY", False):
        stats["reason"] = "CuPy keeps compiled kernels in memory only (CUPY_CACHE_IN_MEMORY): nothing to share"
        return None
    parts = _cupy_parts()
    if parts is None:
        stats["reason"] = "this CuPy's compile path differs from the one FLAME hooks"
        return None
    _, _, version, header, ref = parts
    entries, why = read_manifest(manifest_path(version), version, header_sha1(header))
    if entries is None:
        stats["reason"] = why
        return None
    if not install_hook():
        stats["reason"] = "cannot hook CuPy's compile path"
        return None
    jobs = replay_jobs(entries, header, ref)
    orig = _orig
    cp = backend.cupy
    compiler = parts[0]
    kind, size = pool_kind()
    cache = cache_dir(compiler)
    marker = marker_path(cache, compiler, version, header, jobs) if cache is not None else None
    if marker is not None and marker.is_file():
        stats["reason"] = (f"every recorded request is in CuPy's cache already (a warm-up finished there: "
                           f"{marker.name})")
        return None
    on_done = (lambda st: _write_marker(marker, st)) if marker is not None else None
    stats["pool"] = kind
    if kind == "processes" and cache is None:  # a cache the workers cannot write into: compile in this process
        kind, size = "threads", num_threads()
        stats["pool"] = "threads (CuPy's cache is not a folder worker processes can share)"

    def init():  # the thread's current device (CuPy's arch lookup reads it; the module loads into its context)
        cp.cuda.runtime.setDevice(device_index)

    kept = []  # the modules the pool loaded stay loaded: no module unload from a side thread mid-run

    def compile_one(payload):
        source, options, kw = payload
        kept.append(orig(source, options, **kw))

    if kind == "threads":
        _pool = WarmPool(jobs, compile_one, size, thread_init=init, counters=stats, on_done=on_done)
        return _pool
    from . import cupy_compile_procs

    def worker_init():  # (on a pool thread, after init(): the arch of device_index, as CuPy computes it here)
        return {"compiler": "cupy", "cupy": version, "header_sha1": header_sha1(header), "arch": compiler._get_arch()}

    env = dict(os.environ, CUPY_CACHE_DIR=cache)
    slots = cupy_compile_procs.ProcessSlots(worker_init, compile_one, stats, setup=init, env=env)
    _pool = WarmPool(jobs, slots.compile, size, thread_init=slots.thread_init, counters=stats,
                     thread_exit=slots.thread_exit, on_done=on_done)
    return _pool


def marker_path(cache, compiler, version, header, jobs):
    """The file a finished warm-up leaves in CuPy's cache folder `cache`: named by everything that decides what the
    replay compiles there (this CuPy, its headers, the GPU architecture and NVRTC version CuPy compiles for, and
    every request in order), so that a later process with the same finds it and starts no pool -- on a machine whose
    cache is warm, no worker processes (an interpreter and CuPy's import each) on every start. None where CuPy's
    architecture or NVRTC version cannot be read (the warm-up then runs every time, as before)."""
    try:
        arch = compiler._get_arch()
        nvrtc = compiler._get_nvrtc_version()
    except Exception:
        return None
    h = hashlib.sha1(repr((FORMAT, version, header_sha1(header), str(arch), tuple(nvrtc))).encode())
    for key, _ in jobs:
        h.update(repr(key).encode())
    return Path(cache) / f"flame-cupy-warmup-{h.hexdigest()[:24]}.done"


def _write_marker(path, st):
    """Leave the marker of a warm-up whose every request compiled (WarmPool calls this once, when the pool has
    finished and the requests the process took back are compiled too): written to a temporary name, synced,
    renamed."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"entries": st.get("entries"), "pool": str(st.get("pool")), "written": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cache_dir(compiler):
    """The folder of CuPy's disk cache in this process (where worker processes must write), or None where CuPy's
    cache is not a plain folder (a custom cache backend)."""
    be = getattr(compiler, "_kernel_cache_backend", None)
    if be is not None:  # CuPy 14: a pluggable backend; the disk one holds its folder
        d = getattr(be, "_cache_dir", None) if type(be).__name__ == "DiskKernelCacheBackend" else None
        return d if isinstance(d, str) else None
    get = getattr(compiler, "get_cache_dir", None)
    return get() if callable(get) else None


def pool():
    """The running WarmPool, or None."""
    return _pool
