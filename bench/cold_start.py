"""Cold start: a fresh machine's first run, from `import` to the demo's first training steps, with and without the
prebuilt kernel binaries (flame_core/kernels/binaries/) and the warm-up of CuPy's own kernels
(flame_core/kernels/cupy_warmup.py).

Each trial is a fresh process with an empty CuPy cache (CUPY_CACHE_DIR in a new temporary folder, so that neither
FLAME's kernels nor CuPy's own are cached) in a new working folder, running the demo with one pretraining step of the
tiny base model and one LoRA step (`python -m flame_models.train --device cuda --demo-base-steps 1 --steps 1`). Modes:
`prebuilt`: the shipped binaries and the CuPy warm-up (the defaults); `nowarm`: the binaries, FLAME_CUPY_WARMUP=0;
`nvrtc`: neither (FLAME_PREBUILT_KERNELS=0, FLAME_CUPY_WARMUP=0: every kernel compiled through NVRTC on demand, as
before both); `threads` and `processes`: the binaries and the warm-up on its thread pool (FLAME_CUPY_WARMUP_PROCESSES=0)
or on its worker processes (FLAME_CUPY_WARMUP_PROCESSES=n: the variable's value when set, else the default size),
whatever the default pool is. Reported per trial: seconds to import flame_core and flame_models; the time from the
start of the import to the end of the first optimizer step (the first pretraining step; the GPU synchronised there)
and what the main thread had waited on CuPy's kernels by then; seconds of the whole demo run after the import; the time
FLAME's kernel loader spent preparing kernels (NVRTC compiles, and loads of shipped binaries) with their counts; the
wall time the main thread spent inside CuPy's compile-or-load function (`wait`: what the process waited for kernels,
FLAME's NVRTC compiles included) and its request count; the NVRTC compiles CuPy ran in this process, in any thread
(count and summed seconds, how many on the warm-up pool's threads, and how many were CuPy's own rather than FLAME's);
what the warm-up did (its pool, manifest entries, compiled, taken back by the process, waits, seconds from its start
to its end; with processes: how many started, the compile seconds they reported, requests compiled in-process
instead, worker failures and the first reason, answers from a worker holding a CUDA context); and how many files
CuPy's cache holds at the end. A table of the main thread's waits per mode ends the output.

`--record-cupy-kernels` makes every trial record the CuPy compile requests it made into the manifest the warm-up
reads (flame_core/kernels/cupy_kernels/cupy-<version>.json.gz, merged): run `nowarm` first so that a later
`prebuilt` trial finds it.

`--warm K` runs K more trials of each mode in the cold trial's CuPy cache (a machine's later runs: the warm-up finds
the marker its first run left and starts no pool); every trial also reports its process's wall time and the CPU
seconds of it and the processes it waited for (the warm-up's workers among them); `--drop-marker` deletes the marker
before each warm trial (the warm-up then replays every request on its pool, as before the marker).

Run: PYTHONPATH=$PWD python3 bench/cold_start.py [--modes nowarm,prebuilt,nvrtc,threads,processes] [--rounds 1]
     [--warm 0] [--drop-marker] [--record-cupy-kernels] [--json OUT.json]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"prebuilt": {"FLAME_PREBUILT_KERNELS": "1", "FLAME_CUPY_WARMUP": "1"},
         "nowarm": {"FLAME_PREBUILT_KERNELS": "1", "FLAME_CUPY_WARMUP": "0"},
         "nvrtc": {"FLAME_PREBUILT_KERNELS": "0", "FLAME_CUPY_WARMUP": "0"},
         "threads": {"FLAME_PREBUILT_KERNELS": "1", "FLAME_CUPY_WARMUP": "1", "FLAME_CUPY_WARMUP_PROCESSES": "0"},
         "processes": {"FLAME_PREBUILT_KERNELS": "1", "FLAME_CUPY_WARMUP": "1"}}  # (+ FLAME_CUPY_WARMUP_PROCESSES)

_CHILD = r"""
import json, os, sys, threading, time
t0 = time.perf_counter()
import flame_core, flame_models.train as T
from flame_core.kernels import cupy_warmup, loader
t1 = time.perf_counter()
write_record = cupy_warmup.record() if os.environ.get("COLD_START_RECORD") == "1" else None
cupy_warmup.install_hook()  # FLAME's hook innermost, so that the timing below includes the waits it makes
main = threading.get_ident()
req = {"n": 0, "s": 0.0}
nvrtc = {"n": 0, "s": 0.0, "pool": 0}
from cupy.cuda import compiler as _cc
_orig_req, _orig_nvrtc = _cc._compile_module_with_cache, _cc._compile_using_nvrtc_no_warning
def _timed(fn, acc, main_only):  # fn counting its calls and seconds into acc (main_only: the main thread's alone;
                                  # else also how many ran on the warm-up pool)
    def wrapped(*a, **k):
        if main_only and threading.get_ident() != main:
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc["n"] += 1
            acc["s"] += time.perf_counter() - t
            if not main_only:
                acc["pool"] += threading.current_thread().name.startswith("flame-cupy-warmup")
    return wrapped
_cc._compile_module_with_cache = _timed(_orig_req, req, True)
_cc._compile_using_nvrtc_no_warning = _timed(_orig_nvrtc, nvrtc, False)
import cupy, flame_nn.optim as _optim
first = {}
depth = [0]
def _first_step(fn):  # the end of the first optimizer step on the main thread (outermost call; GPU synchronised)
    def wrapped(*a, **k):
        depth[0] += 1
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            if not first and not depth[0] and threading.get_ident() == main:
                cupy.cuda.runtime.deviceSynchronize()
                first.update(s=time.perf_counter() - t0, wait_s=req["s"], requests=req["n"])
    return wrapped
for _c in {getattr(_optim, _n) for _n in _optim.__all__}:
    if isinstance(_c, type) and issubclass(_c, _optim.Optimizer) and "step" in vars(_c):
        _c.step = _first_step(vars(_c)["step"])
rc = T.main(["--device", "cuda", "--demo-base-steps", "1", "--steps", "1"])
cupy.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
p = cupy_warmup.pool()
if p is not None:
    p.join(60)
w = dict(cupy_warmup.stats)
w["span_s"] = None if w["started"] is None or w["finished"] is None else w["finished"] - w["started"]
w["start_after_import_s"] = None if w["started"] is None else w["started"] - t1
del w["started"], w["finished"]
print("COLD_START " + json.dumps({"rc": rc, "import_s": t1 - t0, "run_s": t2 - t1, "stats": loader.stats,
                                  "nvrtc_version": list(cupy.cuda.nvrtc.getVersion()), "cupy": cupy.__version__,
                                  "cupy_requests": req["n"], "cupy_wait_s": req["s"], "first_step": first or None,
                                  "nvrtc_compiles": nvrtc["n"], "nvrtc_compile_s": nvrtc["s"],
                                  "nvrtc_on_pool": nvrtc["pool"],
                                  "cupy_own_compiles": nvrtc["n"] - loader.stats["nvrtc_compiles"],
                                  "warmup": w, "recorded": write_record() if write_record else None,
                                  "nvrtc_log": [[s, list(e)] for s, e in loader.nvrtc_log]}))
"""


def mode_env(mode, environ=None):
    """The environment of a `mode` trial (less the cache and recording variables)."""
    env = dict(os.environ if environ is None else environ, **MODES[mode])
    if mode == "processes":
        env.pop("FLAME_CUPY_WARMUP_THREADS", None)
        if env.get("FLAME_CUPY_WARMUP_PROCESSES", "").strip() in ("", "0"):
            if REPO not in sys.path:
                sys.path.insert(0, REPO)
            from flame_core.kernels.cupy_warmup import default_size
            env["FLAME_CUPY_WARMUP_PROCESSES"] = str(default_size())
    return env


def trial(mode, record=False, cache=None, label=None):
    """One fresh process running the demo; `cache`: CuPy's cache folder to use (default: a new empty one), `label`:
    the mode's name in the record (a warm trial's)."""
    with tempfile.TemporaryDirectory(prefix="flame-cold-") as tmp:
        if cache is None:
            cache = os.path.join(tmp, "cupy_cache")  # empty: nothing of CuPy's or FLAME's compiled yet
        env = dict(mode_env(mode), CUPY_CACHE_DIR=cache, COLD_START_RECORD="1" if record else "0",
                   PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("FLAME_CUPY_KERNELS_RECORD", None)  # recording is --record-cupy-kernels' (COLD_START_RECORD)
        env.pop("CUPY_CACHE_IN_MEMORY", None)       # (the warm-up shares CuPy's disk cache)
        t = time.perf_counter()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([sys.executable, "-c", _CHILD], cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=900, check=False)
        wall = time.perf_counter() - t
        ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the demo's process and the processes it waited for
        cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
        mode_name = label or mode
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("COLD_START ")), None)
        if r.returncode != 0 or line is None:
            return {"mode": mode_name, "error": (r.stderr or r.stdout)[-3000:]}
        res = json.loads(line[len("COLD_START "):])
        if res["rc"]:
            return {"mode": mode_name, "error": f"the demo exited {res['rc']}: {(r.stderr or r.stdout)[-3000:]}"}
        res.update(mode=mode_name, process_s=wall, cpu_s=cpu,
                   cupy_cache_files=sum(len(f) for _, _, f in os.walk(cache)) if os.path.isdir(cache) else 0,
                   nvrtc_by_file=dict(Counter(s for s, _ in res["nvrtc_log"])))
        return res


def _pool(w):
    if w.get("pool") is None or not w.get("threads"):
        return "-"
    if w["pool"] != "processes":
        return f"{w['threads']} threads"
    return f"{w['processes']} of {w['threads']} processes"


def _workers(w):
    if w.get("pool") != "processes":
        return ""
    return (f"  workers: {w['processes']} started, compiles {w['worker_seconds']:.2f} s summed, {w['in_process']} "
            f"compiled in-process instead, {w['worker_failures']} failures"
            + (f" ({w['worker_error']})" if w["worker_error"] else "") + f", {w['worker_contexts']} with a context")


def line(r):
    """One trial as a line of text."""
    s, w, f = r["stats"], r["warmup"], r.get("first_step") or {}
    span = "-" if w["span_s"] is None else f"{w['span_s']:.2f} s"
    first = "-" if not f else f"{f['s']:.2f} s (CuPy wait {f['wait_s']:.2f} s, {f['requests']} requests)"
    return (f"{r['mode']:9s} import {r['import_s']:5.2f} s  first step at {first}  "
            f"demo (1+1 steps) {r['run_s']:6.2f} s  process {r['process_s']:.2f} s, CPU {r['cpu_s']:.2f} s  "
            f"FLAME kernels prepared {s['nvrtc_seconds'] + s['prebuilt_seconds']:6.2f} s "
            f"(NVRTC {s['nvrtc_compiles']} modules {s['nvrtc_seconds']:.2f} s, prebuilt {s['prebuilt_loads']} "
            f"{s['prebuilt_seconds']:.2f} s)  waited on CuPy compile/load {r['cupy_wait_s']:6.2f} s "
            f"({r['cupy_requests']} requests)  NVRTC compiles {r['nvrtc_compiles']} "
            f"({r['cupy_own_compiles']} CuPy's own, "
            f"{r['nvrtc_on_pool']} on the warm-up pool) summing {r['nvrtc_compile_s']:.2f} s  "
            f"warm-up: {w['reason']}, {_pool(w)}, {w['entries']} entries, {w['compiled']} compiled, "
            f"{w['failed']} failed, "
            f"{w['taken']} taken back, {w['waits']} waits {w['wait_seconds']:.2f} s, span {span}{_workers(w)}  "
            f"CuPy cache files {r['cupy_cache_files']}  NVRTC by file {r['nvrtc_by_file']}"
            + ("" if r.get("recorded") is None else f"  manifest entries now {r['recorded']}"))


def table(records):
    """The main thread's waits per trial: the figure issue 48 asks for (<= 5 s of kernel preparation before the
    first step) is `waited on CuPy by the first step` plus FLAME's own kernel preparation."""
    rows = ["", f"cores {len(os.sched_getaffinity(0))}",
            "| mode | pool | waited on CuPy by the first step s | FLAME kernels prepared s | first step at s "
            "| waited on CuPy in all s | demo s | process s | CPU s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['mode']} | FAILED | | | | | | | |")
            continue
        f, s = r.get("first_step") or {}, r["stats"]
        rows.append(f"| {r['mode']} | {_pool(r['warmup'])} | "
                    + ("-" if not f else f"{f['wait_s']:.2f}") + f" | {s['nvrtc_seconds'] + s['prebuilt_seconds']:.2f}"
                    + " | " + ("-" if not f else f"{f['s']:.2f}") + f" | {r['cupy_wait_s']:.2f} | {r['run_s']:.2f} "
                    + f"| {r['process_s']:.2f} | {r['cpu_s']:.2f} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="nowarm,prebuilt,nvrtc", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--record-cupy-kernels", action="store_true",
                    help="each trial records its CuPy compile requests into the warm-up's manifest (merged)")
    ap.add_argument("--warm", type=int, default=0,
                    help="after each mode's cold trial, this many more in the same CuPy cache (a machine's later runs)")
    ap.add_argument("--drop-marker", action="store_true",
                    help="delete the warm-up's marker before each warm trial (how a warm machine started before it)")
    ap.add_argument("--json", help="write every trial's record here")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"cold_start: --modes: {bad} (choose from {', '.join(MODES)})", file=sys.stderr)
        return 2
    records = []
    for _ in range(a.rounds):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="flame-cold-cache-") as keep:
                cache = os.path.join(keep, "cupy_cache")
                for k in range(1 + max(0, a.warm)):
                    if k and a.drop_marker and os.path.isdir(cache):
                        for f in os.listdir(cache):
                            if f.startswith("flame-cupy-warmup-") and f.endswith(".done"):
                                os.remove(os.path.join(cache, f))
                    r = trial(mode, record=a.record_cupy_kernels, cache=cache, label=f"{mode}+warm{k}" if k else mode)
                    records.append(r)
                    print(f"{r['mode']:9s} FAILED: {r['error']}" if "error" in r else line(r), flush=True)
    print(table(records))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
