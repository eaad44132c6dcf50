"""Cold start: a fresh machine's first run, from `import` to the demo's first training steps, with and without the
prebuilt kernel binaries (flame_core/kernels/binaries/).

Each trial is a fresh process with an empty CuPy cache (CUPY_CACHE_DIR in a new temporary folder, so that neither
FLAME's kernels nor CuPy's own are cached) in a new working folder, running the demo with one pretraining step of the
tiny base model and one LoRA step (`python -m flame_models.train --device cuda --demo-base-steps 1 --steps 1`). Mode
`prebuilt`: FLAME_PREBUILT_KERNELS=1 (the shipped binaries where they run); `nvrtc`: =0 (every kernel compiled
through NVRTC, as before them). Reported per trial: seconds to import flame_core and flame_models; seconds of the
whole demo run after the import; the time FLAME's kernel loader spent preparing kernels (NVRTC compiles, and loads of
shipped binaries) with their counts; the NVRTC-compiled modules by file (what the binaries lack); every module CuPy
compiled (FLAME's through NVRTC and CuPy's own elementwise / reduction kernels, which compile in both modes) with its
time, and how many files CuPy's cache holds at the end.

Run: PYTHONPATH=$PWD python3 bench/cold_start.py [--modes prebuilt,nvrtc] [--rounds 1] [--json OUT.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import flame_core, flame_models.train as T
from flame_core.kernels import loader
t1 = time.perf_counter()
compile_s = []  # every module CuPy builds or loads from its cache (FLAME's NVRTC path and CuPy's own kernels)
try:
    from cupy.cuda import compiler as _cc
    _orig = _cc._compile_module_with_cache
    def _timed(*a, **k):
        t = time.perf_counter()
        try:
            return _orig(*a, **k)
        finally:
            compile_s.append(time.perf_counter() - t)
    _cc._compile_module_with_cache = _timed
except (ImportError, AttributeError):
    compile_s = None
rc = T.main(["--device", "cuda", "--demo-base-steps", "1", "--steps", "1"])
import cupy
cupy.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
print("COLD_START " + json.dumps({"rc": rc, "import_s": t1 - t0, "run_s": t2 - t1, "stats": loader.stats,
                                  "nvrtc_version": list(cupy.cuda.nvrtc.getVersion()),
                                  "cupy_compiles": None if compile_s is None else len(compile_s),
                                  "cupy_compile_s": None if compile_s is None else sum(compile_s),
                                  "nvrtc_log": [[s, list(e)] for s, e in loader.nvrtc_log]}))
"""


def trial(mode):
    with tempfile.TemporaryDirectory(prefix="flame-cold-") as tmp:
        cache = os.path.join(tmp, "cupy_cache")
        env = dict(os.environ, CUPY_CACHE_DIR=cache, FLAME_PREBUILT_KERNELS="1" if mode == "prebuilt" else "0",
                   PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _CHILD], cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=900, check=False)
        wall = time.perf_counter() - t
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("COLD_START ")), None)
        if r.returncode != 0 or line is None:
            return {"mode": mode, "error": (r.stderr or r.stdout)[-3000:]}
        res = json.loads(line[len("COLD_START "):])
        if res["rc"]:
            return {"mode": mode, "error": f"the demo exited {res['rc']}: {(r.stderr or r.stdout)[-3000:]}"}
        res.update(mode=mode, process_s=wall,
                   cupy_cache_files=sum(len(f) for _, _, f in os.walk(cache)) if os.path.isdir(cache) else 0,
                   nvrtc_by_file=dict(Counter(s for s, _ in res["nvrtc_log"])))
        return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="prebuilt,nvrtc")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write every trial's record here")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in ("prebuilt", "nvrtc")]
    if bad:
        print(f"cold_start: --modes: {bad} (choose from prebuilt, nvrtc)", file=sys.stderr)
        return 2
    records = []
    for _ in range(a.rounds):
        for mode in modes:
            r = trial(mode)
            records.append(r)
            if "error" in r:
                print(f"{mode:8s} FAILED: {r['error']}", flush=True)
                continue
            s = r["stats"]
            print(f"{mode:8s} import {r['import_s']:5.2f} s  demo (1+1 steps) {r['run_s']:6.2f} s  "
                  f"kernels prepared {s['nvrtc_seconds'] + s['prebuilt_seconds']:6.2f} s "
                  f"(NVRTC {s['nvrtc_compiles']} modules {s['nvrtc_seconds']:.2f} s, prebuilt {s['prebuilt_loads']} "
                  f"{s['prebuilt_seconds']:.2f} s)  all CuPy compiles {r['cupy_compiles']} "
                  f"{r['cupy_compile_s'] or 0:.2f} s  CuPy cache files {r['cupy_cache_files']}  "
                  f"NVRTC by file {r['nvrtc_by_file']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
