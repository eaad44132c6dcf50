"""On a GPU: the CuPy warm-up's pools compile real CuPy requests (the first 24 of the shipped manifest) into an empty
CuPy cache, in a fresh process each (tests/kernels/cupy_warmup_probe.py). The process then finds every request in the
cache (no NVRTC compile left to it, every module loads), and worker processes take no GPU memory (no CUDA context:
the device's free memory does not drop while they run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
N = 24
pytestmark = pytest.mark.gpu


def _probe(tmp_path, **env_vars):
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "cache"), FLAME_CUPY_WARMUP="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **env_vars)
    for name in ("FLAME_CUPY_WARMUP_PROCESSES", "FLAME_CUPY_WARMUP_THREADS", "CUPY_CACHE_IN_MEMORY",
                 "FLAME_CUPY_KERNELS_RECORD", "FLAME_DEVICE"):  # (the probe starts the warm-up itself)
        if name not in env_vars:
            env.pop(name, None)
    r = subprocess.run([sys.executable, str(REPO / "tests" / "kernels" / "cupy_warmup_probe.py"), str(N)], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{env_vars}: {out['entries']} requests, pool span {out['span_s']:.2f} s, stats {out['stats']}, "
          f"free memory dropped {out['free_drop_mib']:.0f} MiB")
    return out


def _all_found(out):
    s = out["stats"]
    assert s["compiled"] == out["entries"] == N and s["failed"] == 0 and s["reason"] == "done", s
    assert out["cache_files"] == N and out["nvrtc_here"] == 0 and out["loaded"] == N, out


@pytest.mark.gpu_exclusive
def test_worker_processes_fill_the_cache_the_process_loads_from_without_a_context(tmp_path):
    out = _probe(tmp_path, FLAME_CUPY_WARMUP_PROCESSES="4")
    s = out["stats"]
    assert s["pool"] == "processes" and s["processes"] == 4 and s["worker_failures"] == 0, s
    assert s["in_process"] == 0 and s["worker_contexts"] == 0, s
    _all_found(out)
    assert out["free_drop_mib"] < 256  # four CUDA contexts would take far more


def test_the_thread_pool_still_fills_the_cache(tmp_path):
    out = _probe(tmp_path, FLAME_CUPY_WARMUP_PROCESSES="0", FLAME_CUPY_WARMUP_THREADS="4")
    assert out["stats"]["pool"] == "threads" and out["stats"]["threads"] == 4
    _all_found(out)


def test_a_second_process_on_the_warm_cache_starts_no_pool_and_compiles_nothing(tmp_path):
    first = _probe(tmp_path, FLAME_CUPY_WARMUP_PROCESSES="0", FLAME_CUPY_WARMUP_THREADS="4")
    _all_found(first)
    assert first["pool_started"] and first["markers"] == 1
    second = _probe(tmp_path, FLAME_CUPY_WARMUP_PROCESSES="2")
    assert not second["pool_started"] and "in CuPy's cache already" in second["stats"]["reason"], second
    assert second["nvrtc_here"] == 0 and second["loaded"] == N and second["cache_files"] == N, second
