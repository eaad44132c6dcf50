"""Preparing CuPy's own kernels on a side pool (flame_core/kernels/cupy_warmup.py), on the CPU with fakes: the manifest
(paths taken out and put back, version and header guards, merging), the recorder, the pool (order, bound, a caller
taking a queued job or waiting for a running one, failures), the switches, and a record-then-replay round trip through
a fake CuPy compiler whose include folders differ between the two "machines". The real compiles: bench/cold_start.py
on a GPU."""
import json
import sys
import threading
import time
import types

import pytest

from flame_core import backend
from flame_core.kernels import cupy_warmup as W

device_mod = sys.modules["flame_core.device"]  # the module (flame_core.device is the function)

HEADER = "// cupy headers\n"
REF_A = ("-I/a/cupy/_cccl/cub", "--std=c++17", "-I/a/cupy/include", "-I/a/cuda/include")
REF_B = ("-I/b/site/cupy/_cccl/cub", "--std=c++17", "-I/b/site/cupy/include", "-I/usr/local/cuda/include")


@pytest.fixture
def fresh(monkeypatch):
    """The module's process-wide state reset for one test (and put back after it)."""
    monkeypatch.setattr(W, "stats", dict(W.stats))
    for name, value in (("_pool", None), ("_started", False), ("_recorder", None), ("_orig", None)):
        monkeypatch.setattr(W, name, value)
    monkeypatch.delenv("FLAME_CUPY_WARMUP", raising=False)
    monkeypatch.delenv("FLAME_CUPY_WARMUP_THREADS", raising=False)
    monkeypatch.delenv("FLAME_CUPY_KERNELS_RECORD", raising=False)
    return monkeypatch


# ----------------------------------------------------------------------------- manifest
def test_options_lose_the_machines_paths_and_get_the_new_ones_back():
    opts = REF_A[:1] + ("-DX=1",) + REF_A[1:]
    stored = W.normalize_options(opts, REF_A)
    assert stored == [{"ref": 0}, "-DX=1", {"ref": 1}, {"ref": 2}, {"ref": 3}]
    assert W.expand_options(stored, REF_B) == REF_B[:1] + ("-DX=1",) + REF_B[1:]
    assert W.expand_options(stored, REF_B[:2]) is None  # a reference this CuPy does not have
    assert W.expand_options([{"ref": "x"}], REF_B) is None


def test_the_request_key_covers_what_cupys_cache_key_does():
    k = W.request_key("src", ["-a"], {"name_expressions": ["f<float>"]})
    assert k == W.request_key("src", ("-a",), {"name_expressions": ("f<float>",), "backend": "nvrtc"})
    assert k != W.request_key("src", ("-a",), {"name_expressions": ("f<double>",)})
    assert k != W.request_key("src", ("-b",), {"name_expressions": ("f<float>",)})
    assert k != W.request_key("src", ("-a",), {"name_expressions": ("f<float>",), "jitify": True})
    assert W.request_key("s", (), {"log_stream": object()}) == W.request_key("s", (), {})


def test_a_manifest_is_used_only_by_its_cupy_version_and_headers(tmp_path):
    path = tmp_path / "m.json.gz"
    entries = [{"source": "a", "options": [{"ref": 2}]}, {"source": "b", "options": []}]
    assert W.write_manifest(path, "14.2.0", "h1", entries, {"nvrtc": [13, 0]}) == 2
    assert W.read_manifest(path, "14.2.0", "h1") == (entries, None)
    got, why = W.read_manifest(path, "14.3.0", "h1")
    assert got is None and "14.2.0" in why and "14.3.0" in why
    got, why = W.read_manifest(path, "14.2.0", "h2")
    assert got is None and "headers" in why
    got, why = W.read_manifest(tmp_path / "none.json.gz", "14.2.0", "h1")
    assert got is None and "no manifest" in why
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    got, why = W.read_manifest(tmp_path / "bad.json.gz", "14.2.0", "h1")
    assert got is None and "unreadable" in why


def test_recording_again_merges_in_order_once_each(tmp_path):
    path = tmp_path / "m.json.gz"
    W.write_manifest(path, "14.2.0", "h", [{"source": "a"}, {"source": "b"}])
    assert W.write_manifest(path, "14.2.0", "h", [{"source": "b"}, {"source": "c"}]) == 3
    assert [e["source"] for e in W.read_manifest(path, "14.2.0", "h")[0]] == ["a", "b", "c"]
    # another CuPy's file is replaced, not merged
    assert W.write_manifest(path, "15.0.0", "h", [{"source": "z"}]) == 1
    assert [e["source"] for e in W.read_manifest(path, "15.0.0", "h")[0]] == ["z"]


def test_the_recorder_keeps_cupys_requests_once_each_and_skips_what_it_cannot_replay():
    rec = W.Recorder(REF_A, HEADER)
    rec.note("k1", REF_A + ("-DA",), {"extra_source": HEADER, "name_expressions": None})
    rec.note("k1", REF_A + ("-DA",), {"extra_source": HEADER})                 # the same request again
    rec.note("k2", (), {"extra_source": None, "name_expressions": ["f<float>"]})
    rec.note("k3", (), {"arch": "90"})                                            # an explicit arch (FLAME's sm_90a)
    rec.note("k4", (), {"to_ltoir": True})
    rec.note("k5", (), {"log_stream": object()})
    rec.note("k6", (), {"extra_source": "// other headers"})
    assert [e["source"] for e in rec.entries] == ["k1", "k2"]
    assert rec.entries[0]["options"] == [{"ref": 0}, {"ref": 1}, {"ref": 2}, {"ref": 3}, "-DA"]
    assert rec.entries[0]["extra_source"] == "headers" and rec.entries[1]["extra_source"] is None
    assert rec.entries[1]["name_expressions"] == ["f<float>"]


# ----------------------------------------------------------------------------- the pool
def _wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_the_pool_compiles_every_job_once_in_order():
    done = []
    p = W.WarmPool([(k, k) for k in "abcab"], done.append, threads=1)
    p.join(5)
    assert done == ["a", "b", "c"]
    assert p.stats["entries"] == 3 and p.stats["compiled"] == 3 and p.stats["reason"] == "done"
    assert p.stats["finished"] >= p.stats["started"]


def test_the_pool_runs_at_most_threads_compiles_at_once_and_in_parallel():
    lock, now, peak = threading.Lock(), [0], [0]

    def compile_fn(_):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.03)
        with lock:
            now[0] -= 1

    p = W.WarmPool([(i, i) for i in range(12)], compile_fn, threads=3)
    assert len(p.threads) == 3 and p.stats["threads"] == 3
    p.join(10)
    assert peak[0] == 3 and p.stats["compiled"] == 12
    assert len(W.WarmPool([(0, 0)], compile_fn, threads=8).threads) == 1  # no more threads than jobs


def test_a_caller_takes_a_queued_job_and_waits_for_a_running_one():
    release, started, ran = threading.Event(), threading.Event(), []

    def compile_fn(k):
        ran.append(k)
        started.set()
        release.wait(5)

    p = W.WarmPool([("a", "a"), ("b", "b"), ("c", "c")], compile_fn, threads=1)
    started.wait(5)                      # "a" runs on the pool, "b" and "c" wait in the queue
    assert p.claim("b") is True          # queued: taken off the queue at once (the caller compiles it)
    assert p.stats["taken"] == 1 and p.stats["waits"] == 0
    waited = []
    t = threading.Thread(target=lambda: waited.append((p.claim("a"), time.perf_counter())[1]))
    t.start()
    time.sleep(0.05)
    assert not waited                    # "a" still compiling: the caller waits for it
    t_release = time.perf_counter()
    release.set()
    t.join(5)
    assert waited and waited[0] >= t_release
    p.join(5)
    assert ran == ["a", "c"]             # "b" never compiled on the pool
    assert p.stats["waits"] == 1 and p.stats["wait_seconds"] > 0
    assert p.claim("a") is False         # done: no wait, nothing taken
    assert p.claim("zzz") is False       # not in the manifest: nothing to do
    assert p.stats["waits"] == 1


def test_failing_compiles_are_counted_not_raised_and_workers_know_themselves():
    seen, made, pools = [], threading.Event(), []

    def compile_fn(k):
        made.wait(5)
        seen.append(pools[0].is_worker())
        if k == "bad":
            raise RuntimeError("nvrtc says no")

    p = W.WarmPool([("bad", "bad"), ("ok", "ok")], compile_fn, threads=1)
    pools.append(p)
    made.set()
    p.join(5)
    assert p.stats["failed"] == 1 and p.stats["compiled"] == 1
    assert seen == [True, True] and not p.is_worker()


def test_a_thread_that_cannot_set_up_compiles_nothing():
    done = []

    def init():
        raise RuntimeError("no device")

    p = W.WarmPool([(1, 1), (2, 2)], done.append, threads=2, thread_init=init)
    p.join(5)
    assert done == [] and p.stats["reason"] == "stopped"


def test_stop_ends_the_pool_after_the_running_job():
    gate = threading.Event()
    p = W.WarmPool([(i, i) for i in range(5)], lambda _: gate.wait(5), threads=1)
    _wait_until(lambda: p._next == 1)
    p.stop()
    gate.set()
    p.join(5)
    assert p.stats["compiled"] == 1 and p.stats["reason"] == "stopped"


def test_an_empty_manifest_starts_no_thread():
    p = W.WarmPool([], lambda _: None, threads=4)
    assert p.threads == [] and p.stats["reason"] == "nothing to compile"


# ----------------------------------------------------------------------------- switches
def test_the_switches(fresh):
    assert W.enabled()
    fresh.setenv("FLAME_CUPY_WARMUP", "0")
    assert not W.enabled()
    assert W.num_threads(cores=16) == 8 and W.num_threads(cores=4) == 3 and W.num_threads(cores=1) == 1
    assert 1 <= W.num_threads() <= W.MAX_THREADS
    fresh.setenv("FLAME_CUPY_WARMUP_THREADS", "12")
    assert W.num_threads(cores=4) == 12
    fresh.setenv("FLAME_CUPY_WARMUP_THREADS", "zero")
    with pytest.raises(ValueError, match="FLAME_CUPY_WARMUP_THREADS"):
        W.num_threads()


def test_start_is_a_no_op_on_the_cpu_and_when_switched_off(fresh):
    fresh.setattr(backend, "cupy", None)
    assert W.start() is None and W.stats["reason"] == "no GPU"
    assert W.start() is None  # once per process
    fresh.setattr(W, "_started", False)
    fresh.setenv("FLAME_CUPY_WARMUP", "0")
    assert W.start() is None and W.stats["reason"].startswith("off")
    assert not W.install_hook() and W.record() is None


def test_the_first_cuda_device_starts_the_warm_up_once(fresh):
    calls = []
    fresh.setattr(W, "start", lambda index=0: calls.append(index))
    fresh.setattr(device_mod, "_cache", {})   # (an earlier test in this process may have parsed "cuda:1")
    fresh.setattr(backend, "cupy", types.SimpleNamespace())
    fresh.setattr(backend, "cuda_available", lambda: True)
    device_mod.device("cpu")
    assert calls == []
    device_mod.device("cuda:1")
    device_mod.device("cuda:1")
    assert calls == [1]
    fresh.setattr(backend, "cupy", None)
    device_mod.device("cuda:2")  # without CuPy: nothing to start (the device itself errors where it is used)
    assert calls == [1]


def test_a_warm_up_that_cannot_start_warns_and_the_device_still_parses(fresh):
    def boom(index=0):
        raise ValueError("FLAME_CUPY_WARMUP_THREADS must be a positive integer, got 'x'")
    fresh.setattr(W, "start", boom)
    fresh.setattr(device_mod, "_cache", {})
    fresh.setattr(backend, "cupy", types.SimpleNamespace())
    fresh.setattr(backend, "cuda_available", lambda: True)
    with pytest.warns(RuntimeWarning, match="compile on first use"):
        assert str(device_mod.device("cuda:3")) == "cuda:3"


# ----------------------------------------------------------------------------- record, then replay elsewhere
class _FakeCompiler:
    """CuPy's _compile_module_with_cache as far as the warm-up sees it: a disk cache keyed by the whole request."""

    def __init__(self):
        self.cache, self.compiles, self.lock = set(), [], threading.Lock()

        def compile_module(source, options=(), *, arch=None, extra_source=None, backend="nvrtc",
                           enable_cooperative_groups=False, name_expressions=None, log_stream=None, jitify=False,
                           to_ltoir=False):
            key = (source, tuple(options), extra_source, None if name_expressions is None else tuple(name_expressions))
            with self.lock:
                if key in self.cache:
                    return ("loaded", key)
            time.sleep(0.01)  # "NVRTC"
            with self.lock:
                self.compiles.append((source, threading.current_thread().name))
                self.cache.add(key)
            return ("compiled", key)

        self._compile_module_with_cache = compile_module


def _fake_cupy(fresh, tmp_path, ref, version="14.2.0"):
    compiler = _FakeCompiler()
    devices = []
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(setDevice=devices.append)))
    fresh.setattr(backend, "cupy", cp)
    fresh.setattr(backend, "cuda_available", lambda: True)
    fresh.setattr(W, "_cupy_parts", lambda: (compiler, None, version, HEADER, ref))
    fresh.setattr(W, "DIR", tmp_path)
    for name, value in (("_pool", None), ("_started", False), ("_recorder", None), ("_orig", None)):
        fresh.setattr(W, name, value)
    return compiler, devices


def _requests(ref):
    """What a process asks CuPy for: the assembled options hold this machine's paths."""
    return [(f"kernel {i}", ref + (f"-DK={i}",), {"extra_source": HEADER, "name_expressions": None}) for i in range(6)]


def test_a_recorded_run_is_replayed_on_another_machine_and_the_process_finds_it_compiled(fresh, tmp_path):
    # machine A records what the process asked CuPy for
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    write = W.record()
    assert compiler._compile_module_with_cache is W._hooked
    for src, opts, kw in _requests(REF_A):
        compiler._compile_module_with_cache(src, opts, **kw)
    assert write() == 6
    assert (tmp_path / "cupy-14.2.0.json.gz").exists()

    # machine B (other include folders), a fresh process: the pool compiles them all, the process then loads them
    compiler, devices = _fake_cupy(fresh, tmp_path, REF_B)
    fresh.setenv("FLAME_CUPY_WARMUP_THREADS", "3")
    p = W.start(device_index=1)
    assert p is not None and W.start() is p
    p.join(10)
    assert devices == [1, 1, 1]
    assert sorted(s for s, _ in compiler.compiles) == sorted(src for src, _, _ in _requests(REF_B))
    assert all(name.startswith("flame-cupy-warmup") for _, name in compiler.compiles)
    for src, opts, kw in _requests(REF_B):
        assert compiler._compile_module_with_cache(src, opts, **kw)[0] == "loaded"
    assert len(compiler.compiles) == 6 and W.stats["compiled"] == 6 and W.stats["reason"] == "done"


def test_no_warm_up_when_cupy_caches_in_memory_only(fresh, tmp_path):
    _fake_cupy(fresh, tmp_path, REF_A)
    fresh.setenv("CUPY_CACHE_IN_MEMORY", "1")
    assert W.start() is None and "CUPY_CACHE_IN_MEMORY" in W.stats["reason"]


def test_another_cupy_version_replays_nothing(fresh, tmp_path):
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    write = W.record()
    for src, opts, kw in _requests(REF_A):
        compiler._compile_module_with_cache(src, opts, **kw)
    write()
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A, version="14.3.0")
    assert W.start() is None and "14.3.0" in W.stats["reason"]
    assert compiler.compiles == []


def test_the_process_waits_for_a_request_the_pool_is_compiling_instead_of_compiling_it_twice(fresh, tmp_path):
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    write = W.record()
    src, opts, kw = _requests(REF_A)[0]
    compiler._compile_module_with_cache(src, opts, **kw)
    write()
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    gate = threading.Event()
    orig = compiler._compile_module_with_cache

    def slow(*a, **k):
        gate.wait(5)
        return orig(*a, **k)

    compiler._compile_module_with_cache = slow  # the hook goes in front of this one
    p = W.start()
    _wait_until(lambda: p._next == 1)  # the pool took it and is "compiling"
    threading.Timer(0.05, gate.set).start()
    assert compiler._compile_module_with_cache(src, opts, **kw)[0] == "loaded"
    assert len(compiler.compiles) == 1 and W.stats["waits"] == 1


def test_flames_own_modules_stay_out_of_the_recording(fresh, tmp_path):
    from flame_core.kernels import loader
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    W.record()
    fresh.setattr(loader, "source", lambda stem: f"// flame {stem}")

    class _Raw:  # the loader's RawModule: its compile goes through CuPy's compile-and-cache function
        def __init__(self, code, options, name_expressions):
            self.code, self.options = code, options

        def compile(self):
            compiler._compile_module_with_cache(self.code, self.options, extra_source=HEADER)

    cp = types.SimpleNamespace(RawModule=_Raw, cuda=types.SimpleNamespace(compiler=types.SimpleNamespace(
        CompileException=RuntimeError)))
    fresh.setattr(loader, "file_arch", lambda stem: None)
    loader._nvrtc_module(cp, "norms", ())
    compiler._compile_module_with_cache("cupy kernel", REF_A, extra_source=HEADER)
    assert [e["source"] for e in W._recorder.entries] == ["cupy kernel"]
    assert len(compiler.compiles) == 2  # both compiled all the same


_SHIPPED = sorted(W.DIR.glob("cupy-*.json.gz"))


def test_the_cupy_version_the_device_runs_has_a_shipped_manifest():
    """CuPy 14.2.0 (the lent GPUs') ships its recorded requests: without it the warm-up replays nothing."""
    assert "cupy-14.2.0.json.gz" in [p.name for p in _SHIPPED]


@pytest.mark.parametrize("path", _SHIPPED, ids=[p.name for p in _SHIPPED])
def test_a_shipped_manifest_names_its_cupy_and_holds_no_machines_paths(path):
    import gzip
    import json
    data = json.loads(gzip.decompress(path.read_bytes()))
    assert data["format"] == W.FORMAT and path.name == f"cupy-{data['cupy']}.json.gz"
    assert data["entries"] and len(data["header_sha1"]) == 40
    for e in data["entries"]:
        assert isinstance(e["source"], str) and e["source"]
        assert e["extra_source"] in (None, "headers") and e["backend"] == "nvrtc"
        # what CuPy adds from this machine (include folders) is stored as a reference, never as a path
        assert not [o for o in e["options"] if isinstance(o, str) and (o.startswith("-I") or "/" in o)]


def test_flame_cupy_kernels_record_writes_the_requests_at_exit(fresh, tmp_path):
    import atexit
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    at_exit = []
    fresh.setattr(atexit, "register", at_exit.append)
    out = tmp_path / "mine" / "requests.json.gz"
    fresh.setenv("FLAME_CUPY_KERNELS_RECORD", str(out))
    fresh.setenv("FLAME_CUPY_WARMUP", "0")
    assert W.start() is None and W.stats["reason"].startswith("off")  # recording does not need the warm-up
    for src, opts, kw in _requests(REF_A)[:3]:
        compiler._compile_module_with_cache(src, opts, **kw)
    assert len(at_exit) == 1 and at_exit[0]() == 3
    assert [e["source"] for e in W.read_manifest(out, "14.2.0", W.header_sha1(HEADER))[0]] == \
        [src for src, _, _ in _requests(REF_A)[:3]]


# ----------------------------------------------------------------------------- the marker of a finished warm-up
def _fake_cupy_with_cache(fresh, tmp_path, arch="90", nvrtc=(13, 0)):
    """_fake_cupy with what the marker reads: CuPy's cache folder, the architecture and the NVRTC version."""
    compiler, devices = _fake_cupy(fresh, tmp_path, REF_A)
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    compiler.get_cache_dir = lambda: str(cache)
    compiler._get_arch = lambda: arch
    compiler._get_nvrtc_version = lambda: nvrtc
    fresh.setenv("FLAME_CUPY_WARMUP_THREADS", "2")
    return compiler, cache


def _recorded(fresh, tmp_path, n=6):
    compiler, _ = _fake_cupy(fresh, tmp_path, REF_A)
    write = W.record()
    for src, opts, kw in _requests(REF_A)[:n]:
        compiler._compile_module_with_cache(src, opts, **kw)
    write()


def test_a_finished_warm_up_leaves_a_marker_and_the_next_process_starts_no_pool(fresh, tmp_path):
    _recorded(fresh, tmp_path)
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    p = W.start()
    p.join(10)
    assert W.stats["reason"] == "done" and W.stats["compiled"] == 6
    markers = list(cache.glob("flame-cupy-warmup-*.done"))
    assert len(markers) == 1 and not list(cache.glob("*.tmp"))
    assert json.loads(markers[0].read_text())["entries"] == 6

    # the next process with the same CuPy, GPU and manifest: no pool, nothing compiled, the reason says why
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    assert W.start() is None and compiler.compiles == []
    assert "in CuPy's cache already" in W.stats["reason"] and markers[0].name in W.stats["reason"]

    # another GPU architecture or NVRTC version: another marker name, the pool runs
    for arch, nvrtc in (("100", (13, 0)), ("90", (13, 1))):
        compiler, cache = _fake_cupy_with_cache(fresh, tmp_path, arch=arch, nvrtc=nvrtc)
        p = W.start()
        assert p is not None
        p.join(10)
        assert len(compiler.compiles) == 6
    assert len(list(cache.glob("flame-cupy-warmup-*.done"))) == 3


def test_another_manifest_is_not_covered_by_the_marker(fresh, tmp_path):
    _recorded(fresh, tmp_path, n=4)
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    W.start().join(10)
    assert len(list(cache.glob("*.done"))) == 1
    _recorded(fresh, tmp_path, n=6)  # merged in: two more requests
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    p = W.start()
    assert p is not None
    p.join(10)
    assert W.stats["entries"] == 6 and len(compiler.compiles) == 6
    assert len(list(cache.glob("*.done"))) == 2


@pytest.mark.parametrize("what", ["failed", "taken"])
def test_no_marker_when_a_request_failed_or_one_taken_back_is_not_compiled(fresh, tmp_path, what):
    _recorded(fresh, tmp_path)
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    inner = compiler._compile_module_with_cache
    if what == "failed":
        def failing(source, options=(), **kw):
            if source == "kernel 3":
                raise RuntimeError("NVRTC says no")
            return inner(source, options, **kw)
        compiler._compile_module_with_cache = failing
        p = W.start()
    else:
        gate = threading.Event()

        def gated(source, options=(), **kw):
            gate.wait(10)
            return inner(source, options, **kw)
        compiler._compile_module_with_cache = gated
        fresh.setenv("FLAME_CUPY_WARMUP_THREADS", "1")
        p = W.start()
        key = p._order[-1].key
        assert p.claim(key)  # the process takes the last request back (and has not compiled it yet)
        gate.set()
    p.join(10)
    assert W.stats["reason"] == "done" and W.stats[what] == 1
    assert not list(cache.glob("flame-cupy-warmup-*"))


@pytest.mark.parametrize("before", [True, False])
def test_the_marker_waits_for_the_requests_the_process_took_back(fresh, tmp_path, before):
    """The process takes the last request back through the hook and compiles it itself: the marker is written once
    the pool has finished and that compile has returned, whichever comes last."""
    _recorded(fresh, tmp_path)
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    fresh.setenv("FLAME_CUPY_WARMUP_THREADS", "1")
    inner = compiler._compile_module_with_cache
    pool_gate, own_gate = threading.Event(), threading.Event()

    def gated(source, options=(), **kw):
        (pool_gate if threading.current_thread().name.startswith("flame-cupy-warmup") else own_gate).wait(10)
        return inner(source, options, **kw)
    compiler._compile_module_with_cache = gated
    p = W.start()
    assert W._orig is gated
    src, opts, kw = _requests(REF_A)[-1]
    own = threading.Thread(target=lambda: W._hooked(src, opts, **kw))
    own.start()
    for _ in range(500):  # until the process has taken it back
        if W.stats["taken"]:
            break
        time.sleep(0.01)
    assert W.stats["taken"] == 1
    first, second = (own_gate, pool_gate) if before else (pool_gate, own_gate)
    first.set()
    (own.join if before else p.join)(10)
    assert not list(cache.glob("*.done"))  # one side still compiling
    second.set()
    own.join(10)
    p.join(10)
    assert W.stats["taken_ok"] == 1 and W.stats["compiled"] == 5 and W.stats["reason"] == "done"
    assert len(list(cache.glob("flame-cupy-warmup-*.done"))) == 1


def test_no_marker_where_cupy_cannot_tell_its_architecture(fresh, tmp_path):
    _recorded(fresh, tmp_path)
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    del compiler._get_nvrtc_version
    W.start().join(10)
    assert W.stats["reason"] == "done" and not list(cache.iterdir())
    compiler, cache = _fake_cupy_with_cache(fresh, tmp_path)
    del compiler._get_arch
    p = W.start()
    assert p is not None
    p.join(10)
    assert not list(cache.iterdir())
