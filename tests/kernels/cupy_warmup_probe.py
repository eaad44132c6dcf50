"""Run by test_cupy_warmup_gpu.py in a fresh process with an empty CUPY_CACHE_DIR: the CuPy warm-up replays the first
N requests of the shipped manifest on the pool FLAME_CUPY_WARMUP_PROCESSES / _THREADS select, while this process
watches the GPU's free memory; then this process asks CuPy for each of those requests itself (through FLAME's hook)
and counts the NVRTC compiles that still happen here. Prints one JSON line. Run again on the same cache, the
warm-up finds the marker the first run left and starts no pool.

    python tests/kernels/cupy_warmup_probe.py N
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(n):
    import cupy as cp

    from flame_core.kernels import cupy_warmup as W
    assert not W._started, "the warm-up already started (FLAME_DEVICE=cuda?): this probe starts its own"
    compiler, _, version, header, ref = W._cupy_parts()
    entries, why = W.read_manifest(W.manifest_path(version), version, W.header_sha1(header))
    if not entries:
        raise SystemExit(f"no manifest to replay: {why}")
    entries = entries[:n]
    W.DIR = Path(tempfile.mkdtemp(prefix="flame-manifest-"))  # the warm-up reads these N requests
    W.write_manifest(W.manifest_path(version), version, W.header_sha1(header), entries)
    cp.cuda.runtime.setDevice(0)
    cp.zeros(1)  # this process's context, before the baseline
    free0 = min_free = cp.cuda.runtime.memGetInfo()[0]
    t = time.perf_counter()
    pool = W.start(0)  # (None when a warm-up already finished in this cache: its marker is there)
    while pool is not None and any(th.is_alive() for th in pool.threads):
        min_free = min(min_free, cp.cuda.runtime.memGetInfo()[0])
        time.sleep(0.005)
    span = time.perf_counter() - t
    here = []
    orig = compiler._compile_using_nvrtc_no_warning

    def counted(*a, **k):
        here.append(1)
        return orig(*a, **k)
    compiler._compile_using_nvrtc_no_warning = counted
    loaded = 0
    for _, (source, options, kw) in W.replay_jobs(entries, header, ref):
        loaded += compiler._compile_module_with_cache(source, options, **kw).ptr != 0
    cache = os.environ["CUPY_CACHE_DIR"]
    stats = {k: v for k, v in W.stats.items() if k not in ("started", "finished")}
    print(json.dumps({"entries": len(entries), "span_s": span, "stats": stats, "nvrtc_here": len(here),
                      "loaded": loaded, "cache_files": len([f for f in os.listdir(cache) if f.endswith(".cubin")]),
                      "free_drop_mib": (free0 - min_free) / 2**20, "pool_started": pool is not None,
                      "markers": len([f for f in os.listdir(cache) if f.startswith("flame-cupy-warmup-")])}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
