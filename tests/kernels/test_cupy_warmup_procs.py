"""The CuPy warm-up's worker processes (flame_core/kernels/cupy_compile_procs.py, cupy_compile_worker.py), on the CPU:
real worker processes running a stand-in compiler (a module written into tmp_path that writes one file per request,
as CuPy's cache would), or a CuPy-shaped stand-in package for the worker's CuPy path. Shares split across processes,
the process taking back a queued request or waiting for one a worker compiles, failing / dying / silent workers
(never a hang, never an error in the parent: the thread compiles in-process instead), the switches, and an exiting
interpreter that neither waits for a worker nor leaves one behind. The real compiles: bench/cold_start.py on a GPU."""
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from flame_core import backend
from flame_core.kernels import cupy_compile_procs as P
from flame_core.kernels import cupy_warmup as W

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE_NVRTC = '''
import os, time

def make(init):
    if init.get("refuse"):
        raise RuntimeError("no NVRTC here")
    out = init["out"]

    def compile_one(job):
        what, _, arg = job["source"].partition(":")
        if what == "sleep":
            time.sleep(float(arg.split(":")[0]))
        elif what == "fail":
            raise RuntimeError("nvrtc says no")
        elif what == "die":
            os._exit(3)
        elif what == "hang":
            time.sleep(60)
        path = os.path.join(out, job["source"].replace(":", "_"))
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        return {"ctx": False}

    return compile_one, {"pid": os.getpid()}
'''


def _wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


@pytest.fixture
def fake_nvrtc(tmp_path):
    """(make a pool of `n` workers over `sources`, the results' folder, the in-process compiles)."""
    (tmp_path / "fake_nvrtc.py").write_text(FAKE_NVRTC)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    in_process, pools = [], []

    def make(sources, n, refuse=False, job_timeout=P.JOB_TIMEOUT):
        counters = {}
        slots = P.ProcessSlots(lambda: {"compiler": "fake_nvrtc:make", "out": str(out), "refuse": refuse},
                               lambda payload: in_process.append(payload[0]), counters, env=env,
                               job_timeout=job_timeout)
        jobs = [(s, (s, ("-DX",), {"extra_source": None})) for s in sources]
        p = W.WarmPool(jobs, slots.compile, n, thread_init=slots.thread_init, counters=counters,
                       thread_exit=slots.thread_exit)
        pools.append(p)
        return p, slots

    yield make, out, in_process
    for p in pools:  # whatever a failing test left running
        p.stop()
        p.join(10)


def _compiled_by(out):
    return {f.name: int(f.read_text()) for f in out.iterdir() if not f.name.endswith(".tmp")}


def test_workers_split_the_queue_and_write_every_result(fake_nvrtc):
    make, out, in_process = fake_nvrtc
    sources = [f"sleep:0.1:{i}" for i in range(9)]
    p, slots = make(sources, 3)
    p.join(20)
    by = _compiled_by(out)
    assert sorted(by) == sorted(s.replace(":", "_") for s in sources)
    assert len(set(by.values())) >= 2 and os.getpid() not in by.values()  # shared out, never in this process
    assert p.stats["processes"] == 3 and p.stats["compiled"] == 9 and p.stats["failed"] == 0
    assert p.stats["in_process"] == 0 and p.stats["worker_failures"] == 0 and p.stats["worker_contexts"] == 0
    assert p.stats["worker_seconds"] >= 0.9 * 0.1 * 9 and p.stats["reason"] == "done"
    assert len(slots.workers) == 3 and all(w.proc.poll() == 0 for w in slots.workers)  # stdin closed: they left


def test_the_process_takes_back_a_queued_request_and_waits_for_one_a_worker_compiles(fake_nvrtc):
    make, out, in_process = fake_nvrtc
    p, _ = make(["sleep:0.6:a", "b", "c"], 1)
    _wait_until(lambda: p._next == 1, timeout=10)  # "a" went to the worker; "b" and "c" wait in the queue
    p.claim("b")
    assert p.stats["taken"] == 1 and p.stats["waits"] == 0
    p.claim("sleep:0.6:a")                        # compiling in the worker: waited for, and its file is there
    assert (out / "sleep_0.6_a").exists() and p.stats["waits"] == 1
    p.join(10)
    assert sorted(_compiled_by(out)) == ["c", "sleep_0.6_a"]  # "b" is the caller's to compile
    assert in_process == []


def test_a_compile_error_in_a_worker_is_counted_and_the_worker_goes_on(fake_nvrtc):
    make, out, _ = fake_nvrtc
    p, slots = make(["fail:x", "ok"], 1)
    p.join(10)
    assert p.stats["failed"] == 1 and p.stats["compiled"] == 1 and p.stats["worker_failures"] == 0
    assert list(_compiled_by(out).values()) == [slots.workers[0].facts["pid"]]


def test_workers_that_cannot_start_leave_their_threads_compiling_in_process(fake_nvrtc):
    make, out, in_process = fake_nvrtc
    p, _ = make(["a", "b", "c"], 2, refuse=True)
    p.join(10)
    assert sorted(in_process) == ["a", "b", "c"] and p.stats["in_process"] == 3 and p.stats["compiled"] == 3
    assert p.stats["processes"] == 0 and p.stats["worker_failures"] == 2
    assert "no NVRTC here" in p.stats["worker_error"] and not list(out.iterdir())


def test_a_worker_that_dies_releases_its_request_and_its_thread_goes_on_in_process(fake_nvrtc):
    make, out, in_process = fake_nvrtc
    p, slots = make(["die:now", "b", "c"], 1)
    _wait_until(lambda: p._next >= 1, timeout=10)
    p.claim("die:now")                 # waited for, and released when the worker died
    p.join(10)
    assert p.stats["failed"] == 1 and p.stats["worker_failures"] == 1 and "exited (code 3)" in p.stats["worker_error"]
    assert in_process == ["b", "c"] and slots.workers[0].proc.poll() == 3


def test_a_silent_worker_is_killed_after_the_job_timeout(fake_nvrtc):
    make, out, in_process = fake_nvrtc
    p, slots = make(["hang:x", "b"], 1, job_timeout=0.5)
    _wait_until(lambda: p._next >= 1, timeout=10)
    t = time.monotonic()
    p.claim("hang:x")
    assert time.monotonic() - t < 5
    p.join(10)
    assert "within 0.5 s" in p.stats["worker_error"] and slots.workers[0].proc.poll() is not None
    assert in_process == ["b"] and p.stats["failed"] == 1


def test_an_exiting_interpreter_neither_waits_for_a_worker_nor_leaves_it_behind(tmp_path):
    (tmp_path / "fake_nvrtc.py").write_text(FAKE_NVRTC)
    out = tmp_path / "out"
    out.mkdir()
    script = textwrap.dedent(f"""
        import os, time
        from flame_core.kernels import cupy_compile_procs as P, cupy_warmup as W
        counters = {{}}
        slots = P.ProcessSlots(lambda: {{"compiler": "fake_nvrtc:make", "out": {str(out)!r}}}, None, counters)
        jobs = [(s, (s, (), {{}})) for s in ("sleep:3:a", "b")]
        p = W.WarmPool(jobs, slots.compile, 1, thread_init=slots.thread_init, counters=counters,
                       thread_exit=slots.thread_exit)
        while not slots.workers or p._next < 1:
            time.sleep(0.01)
        print("WORKER", slots.workers[0].proc.pid, flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline().split("WORKER")[1])  # the worker is on its 3 s request now
        t = time.monotonic()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert time.monotonic() - t < 1.5  # the interpreter exited without waiting for the worker's request...

    def gone():
        try:
            with open(f"/proc/{pid}/status") as f:
                return "\nState:\tZ" in f.read()
        except FileNotFoundError:
            return True
    _wait_until(gone, timeout=10)  # ...and the worker finished its request, saw its stdin closed, and left
    assert sorted(_compiled_by(out)) == ["sleep_3_a"]


# ----------------------------------------------------------------------------- the worker's CuPy path
FAKE_CUPY = {
    "cupy/__init__.py": "__version__ = '14.2.0'\n",
    "cupy/_core/__init__.py": "",
    "cupy/_core/core.py": "def _get_header_source():\n    return '// cupy headers\\n'\n",
    "cupy/cuda/__init__.py": "",
    "cupy/cuda/function.py": textwrap.dedent("""
        class Module:
            def __init__(self):
                self.mapping = None
            def load(self, cubin):
                raise RuntimeError("cuModuleLoadData: no CUDA context in this process")
            def _set_mapping(self, mapping):
                self.mapping = mapping
        """),
    "cupy/cuda/compiler.py": textwrap.dedent("""
        import json, os
        from cupy.cuda import function

        def _compile_module_with_cache(source, options=(), *, arch=None, extra_source=None, backend="nvrtc",
                                       enable_cooperative_groups=False, name_expressions=None, log_stream=None,
                                       jitify=False, to_ltoir=False):
            assert arch is not None, "the worker must pass the parent's arch (no device lookup)"
            mod = function.Module()
            mod._set_mapping({ne: "_Z" + ne for ne in name_expressions or ()})
            path = os.path.join(os.environ["CUPY_CACHE_DIR"], source + ".cubin")
            with open(path, "w") as f:
                json.dump({"options": list(options), "arch": arch, "extra": extra_source, "backend": backend,
                           "ne": name_expressions, "mapping": mod.mapping}, f)
            mod.load(b"cubin")
            return mod
        """),
    "cupy_backends/__init__.py": "",
    "cupy_backends/cuda/__init__.py": "",
    "cupy_backends/cuda/api/__init__.py": "",
    "cupy_backends/cuda/api/driver.py": "def ctxGetCurrent():\n    return 0\n",
}


def test_the_worker_compiles_through_cupys_function_without_loading_a_module(tmp_path):
    import json
    for rel, text in FAKE_CUPY.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path), CUPY_CACHE_DIR=str(cache))
    init = {"compiler": "cupy", "cupy": "14.2.0", "header_sha1": W.header_sha1("// cupy headers\n"), "arch": "90"}
    w = P.Worker(init, env=env, ready_timeout=20)
    try:
        assert w.facts["cupy"] == "14.2.0" and w.facts["cache_dir"] == str(cache)
        payload = ("k1", ("-I/x", "-DA"), {"extra_source": "// cupy headers\n", "name_expressions": ["f<float>"]})
        msg = w.run(P.job_message(payload))
        assert msg["ok"] and msg["ctx"] is False, msg
        got = json.loads((cache / "k1.cubin").read_text())
        assert got == {"options": ["-I/x", "-DA"], "arch": "90", "extra": "// cupy headers\n", "backend": "nvrtc",
                       "ne": ["f<float>"], "mapping": {"f<float>": "_Zf<float>"}}
        assert w.run(P.job_message(("k2", (), {"extra_source": None})))["ok"]
        assert json.loads((cache / "k2.cubin").read_text())["extra"] is None
    finally:
        w.close(wait=5)
    assert w.proc.returncode == 0
    # another CuPy, or other headers: the worker refuses to start (the parent compiles in-process)
    for bad in ({"cupy": "14.3.0"}, {"header_sha1": W.header_sha1("// other")}):
        with pytest.raises(P.WorkerError, match="14.3.0|headers differ"):
            P.Worker(dict(init, **bad), env=env, ready_timeout=20)


# ----------------------------------------------------------------------------- the switches and start()
@pytest.fixture
def env(monkeypatch):
    for name in ("FLAME_CUPY_WARMUP_PROCESSES", "FLAME_CUPY_WARMUP_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_pool_switches(env):
    assert W.DEFAULT_POOL == "processes"
    assert W.pool_kind(cores=16) == ("processes", 8) and W.pool_kind(cores=3) == ("processes", 2)
    env.setenv("FLAME_CUPY_WARMUP_PROCESSES", "3")
    assert W.pool_kind(cores=16) == ("processes", 3)
    env.setenv("FLAME_CUPY_WARMUP_PROCESSES", "0")
    assert W.pool_kind(cores=16) == ("threads", 8)
    env.setenv("FLAME_CUPY_WARMUP_THREADS", "5")
    assert W.pool_kind(cores=16) == ("threads", 5)
    env.delenv("FLAME_CUPY_WARMUP_PROCESSES")
    assert W.pool_kind(cores=16) == ("threads", 5)  # THREADS alone keeps its old meaning
    env.setenv("FLAME_CUPY_WARMUP_PROCESSES", "2")
    with pytest.raises(ValueError, match="set one"):
        W.pool_kind()
    env.delenv("FLAME_CUPY_WARMUP_THREADS")
    for bad in ("-1", "two"):
        env.setenv("FLAME_CUPY_WARMUP_PROCESSES", bad)
        with pytest.raises(ValueError, match="FLAME_CUPY_WARMUP_PROCESSES"):
            W.pool_kind()
    env.setattr(W, "DEFAULT_POOL", "threads")
    env.delenv("FLAME_CUPY_WARMUP_PROCESSES")
    assert W.pool_kind(cores=16) == ("threads", 8)


def test_the_cache_folder_the_workers_write_into():
    class DiskKernelCacheBackend:
        _cache_dir = "/c/cupy"

    class OtherBackend:
        _cache_dir = "/c/other"

    assert W.cache_dir(types.SimpleNamespace(_kernel_cache_backend=DiskKernelCacheBackend())) == "/c/cupy"
    assert W.cache_dir(types.SimpleNamespace(_kernel_cache_backend=OtherBackend())) is None
    assert W.cache_dir(types.SimpleNamespace(get_cache_dir=lambda: "/c/old")) == "/c/old"
    assert W.cache_dir(types.SimpleNamespace()) is None


def test_start_runs_workers_and_without_cupy_in_them_compiles_in_process(env, tmp_path):
    """start() with a CuPy-shaped fake in this process: the workers it starts import the real CuPy -- absent on the
    CPU machine, and on a GPU one whose headers are not the fake's -- so each refuses to start and its thread
    compiles in-process; every request is still compiled."""
    env.setattr(W, "stats", dict(W.stats))
    for name, value in (("_pool", None), ("_started", False), ("_recorder", None), ("_orig", None)):
        env.setattr(W, name, value)
    env.delenv("FLAME_CUPY_WARMUP", raising=False)
    env.delenv("FLAME_CUPY_KERNELS_RECORD", raising=False)
    env.setenv("FLAME_CUPY_WARMUP_PROCESSES", "2")
    ref = ("-I/a/include", "--std=c++17")
    compiled = []

    class DiskKernelCacheBackend:
        _cache_dir = str(tmp_path)

    def compile_module(source, options=(), **kw):
        compiled.append((source, threading.current_thread().name))

    compiler = types.SimpleNamespace(_compile_module_with_cache=compile_module, _get_arch=lambda: "90",
                                     _kernel_cache_backend=DiskKernelCacheBackend())
    env.setattr(backend, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(setDevice=lambda i: None))))
    env.setattr(backend, "cuda_available", lambda: True)
    env.setattr(W, "_cupy_parts", lambda: (compiler, None, "14.2.0", "// h\n", ref))
    env.setattr(W, "DIR", tmp_path)
    W.write_manifest(W.manifest_path("14.2.0"), "14.2.0", W.header_sha1("// h\n"),
                     [{"source": f"k{i}", "options": [{"ref": 0}], "extra_source": "headers"} for i in range(4)])
    p = W.start()
    p.join(20)
    assert W.stats["pool"] == "processes" and W.stats["threads"] == 2
    assert W.stats["worker_failures"] == 2 and "cupy" in W.stats["worker_error"].lower()
    assert sorted(s for s, _ in compiled) == ["k0", "k1", "k2", "k3"] and W.stats["in_process"] == 4
    assert all(name.startswith("flame-cupy-warmup") for _, name in compiled)
