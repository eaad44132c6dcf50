"""FLAME memory pool on the GPU: device mallocs in the steady state, pool overhead per allocation, FLAME's peak
against the driver, and the memory limit's OOM report.

1. A training step of a 24-layer, width-4096 bf16 MLP (8192 tokens, relu, SGD, gradients in grad_pool buffers):
   after warm-up, device mallocs per step (pool stats), allocations per step, step time (CUDA events, median).
2. Pool overhead: the exact malloc/free sequence of one step replayed against the live pool (Python time per
   malloc+free pair), and cupy.empty+del through FLAME's pool vs CuPy's own MemoryPool.
3. Peak vs driver: after empty_cache, one step from a cold cache; FLAME's max reserved / allocated against the
   device memory the driver reports in use (cudaMemGetInfo, minus the baseline taken before the step).
4. Limit: a model needing ~30 GiB (measured unlimited first) under set_memory_limit(24 GiB) raises
   OutOfMemoryError (report printed); the same process then runs the 4096-wide step under that limit.
PyTorch runs the same MLP step in the same process (after FLAME let go of its memory) for comparison.
Run: PYTHONPATH=$PWD python3 bench/memory.py
"""
import argparse
import itertools
import os
import statistics
import time
import traceback

import common

import flame_core as flame
import flame_core.memory as M
from flame_core import grad_pool
from flame_core.memory import cuda as mcuda
from flame_core.memory.stats import fmt_bytes

GiB = 1 << 30
DEVICE = "cuda"


def make_mlp(layers, width, tokens, seed=0):
    flame.manual_seed(seed)
    ws = [(flame.randn(width, width, dtype=flame.bfloat16, device=DEVICE) * width ** -0.5).requires_grad_()
          for _ in range(layers)]
    grad_pool.register(ws)
    x = flame.randn(tokens, width, dtype=flame.bfloat16, device=DEVICE)
    return ws, x


def train_step(ws, x, lr=1e-3):
    h = x
    for w in ws:
        h = (h @ w).relu()
    loss = h.float().square().mean()
    del h
    loss.backward()
    for w in ws:
        w.array[...] -= lr * w.grad.array
    grad_pool.zero_grad(ws)


def driver_used():
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def nvidia_smi_process_mib():
    """This process's GPU memory as nvidia-smi reports it (MiB; CUDA context and libraries included), or None."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()):
            return int(parts[1])
    return None


def record_sequence(pool, fn):
    """The (malloc size | free index) sequence the pool sees while fn runs."""
    seq, ids, counter = [], {}, itertools.count()

    def obs(event, p, blk):
        if event == "alloc":
            ids[id(blk)] = k = next(counter)
            seq.append(("a", blk.requested, k))
        elif event == "free" and id(blk) in ids:
            seq.append(("f", None, ids.pop(id(blk))))
    pool.observer = obs
    try:
        fn()
    finally:
        pool.observer = None
    return seq


def replay_us_per_pair(pool, seq, reps=20):
    """Replay the step's allocation pattern against the live pool; µs per malloc+free pair."""
    n_alloc = sum(1 for op in seq if op[0] == "a")
    times = []
    for _ in range(reps):
        live = {}
        t = time.perf_counter()
        for op, size, k in seq:
            if op == "a":
                live[k] = pool.malloc(size)
            else:
                pool.free(live.pop(k))
        for p in live.values():
            pool.free(p)
        times.append((time.perf_counter() - t) / max(n_alloc, 1) * 1e6)
    return statistics.median(times), n_alloc


def empty_del_us(alloc_ctx, sizes, reps=2000):
    import cupy
    with alloc_ctx:
        for n in sizes:
            cupy.empty(n, dtype=cupy.uint8)
        t = time.perf_counter()
        for _ in range(reps):
            for n in sizes:
                a = cupy.empty(n, dtype=cupy.uint8)
                del a
        return (time.perf_counter() - t) / (reps * len(sizes)) * 1e6


def torch_step_figures(layers, width, tokens, reps):
    try:
        import torch
    except Exception:
        return None
    torch.manual_seed(0)
    ws = [(torch.randn(width, width, dtype=torch.bfloat16, device="cuda") * width ** -0.5).requires_grad_()
          for _ in range(layers)]
    x = torch.randn(tokens, width, dtype=torch.bfloat16, device="cuda")

    def step():
        h = x
        for w in ws:
            h = torch.relu(h @ w)
        loss = h.float().square().mean()
        del h
        loss.backward()
        with torch.no_grad():
            for w in ws:
                w -= 1e-3 * w.grad
                w.grad.zero_()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = common.cuda_ms(step, reps, warmup=0, lib="torch")[2]
    out = {"step_ms": statistics.median(ms), "max_allocated": torch.cuda.max_memory_allocated(),
           "max_reserved": torch.cuda.max_memory_reserved()}
    ws = x = None  # frees them (rebound, not deleted: the closures above use the names)
    torch.cuda.empty_cache()
    return out


def oom_demo(limit, layers=24, width=8192, tokens=49152):
    """A ~30 GiB step (24 layers, width 8192, 49152 tokens) measured unlimited, then run under `limit`."""
    ws, x = make_mlp(layers, width, tokens, seed=1)
    M.reset_peak_memory_stats()
    train_step(ws, x)
    need = M.max_memory_allocated()
    M.set_memory_limit(limit)  # releases the cache down to the limit
    M.set_tracking(True)
    report, allocated_at_oom = None, None
    try:
        train_step(ws, x)
    except flame.OutOfMemoryError as e:
        report = str(e)
        allocated_at_oom = M.memory_allocated()
    finally:
        M.set_tracking(False)
    ws = x = None  # frees them (rebound, not deleted: the closures above use the names)
    return {"need_bytes": need, "limit": limit, "raised": report is not None, "report": report,
            "allocated_at_oom": allocated_at_oom}


def guarded(fn):
    """Run one section; on failure print the traceback and go on (the other figures still come out)."""
    try:
        return fn()
    except Exception:
        traceback.print_exc()
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--oom-width", type=int, default=8192)
    ap.add_argument("--oom-tokens", type=int, default=49152)
    ap.add_argument("--limit-gib", type=float, default=24.0)
    args = ap.parse_args()
    import cupy
    assert mcuda.is_installed(), "FLAME's pool is not CuPy's allocator"
    dev = cupy.cuda.Device()
    pool = mcuda.pool_for(dev.id)
    res = common.Results("memory")
    L, W, T = args.layers, args.width, args.tokens
    limit = int(args.limit_gib * GiB)

    # baseline: CUDA context, cuBLAS handle/workspace and every kernel of the step loaded, pool empty
    ws, x = make_mlp(1, W, T)
    train_step(ws, x)
    ws = x = None  # frees them (rebound, not deleted: the closures above use the names)
    M.empty_cache()
    cupy.cuda.runtime.deviceSynchronize()
    base_driver = driver_used()
    base_smi = nvidia_smi_process_mib()
    r0, a0 = M.memory_reserved(), M.memory_allocated()  # what stays live (RNG state etc.): in the baseline

    # 3. peak vs driver from a cold cache (params/grads/input created inside the measurement); the pool keeps
    # what it reserved, so the driver's usage after the step is its usage at the peak
    ws, x = make_mlp(L, W, T)
    M.reset_peak_memory_stats()
    train_step(ws, x)
    cupy.cuda.runtime.deviceSynchronize()
    drv = driver_used() - base_driver
    smi = nvidia_smi_process_mib()
    peak_res, peak_alloc = M.max_memory_reserved() - r0, M.max_memory_allocated() - a0
    res["peak_vs_driver"] = {"flame_max_reserved": peak_res, "flame_max_allocated": peak_alloc,
                             "flame_reserved_now": M.memory_reserved() - r0, "driver_used_delta": drv,
                             "baseline_reserved": r0, "baseline_driver_used": base_driver,
                             "nvidia_smi_process_mib_before_after": [base_smi, smi],
                             "reserved_over_driver": peak_res / drv, "allocated_over_driver": peak_alloc / drv}

    # 1. steady state: device mallocs and step time
    for _ in range(2):
        train_step(ws, x)
    M.reset_peak_memory_stats()
    s0 = M.memory_stats()
    ms = common.cuda_ms(lambda: train_step(ws, x), args.reps, warmup=0)[0]
    s1 = M.memory_stats()
    flame_step = {"max_allocated": M.max_memory_allocated() - a0, "max_reserved": M.max_memory_reserved() - r0}
    steps = args.reps
    res["steady_state"] = {
        "steps": steps, "step_ms": ms,
        "device_mallocs": s1["num_device_alloc"] - s0["num_device_alloc"],
        "device_frees": s1["num_device_free"] - s0["num_device_free"],
        "allocs_per_step": (s1["num_alloc"] - s0["num_alloc"]) / steps,
        "cache_hits": s1["cache_hits"] - s0["cache_hits"], "cache_misses": s1["cache_misses"] - s0["cache_misses"],
    }

    # the profiler on one steady-state step: timeline and the owners of the peak
    def profile():
        out_dir = os.path.dirname(os.path.abspath(res.path))
        with M.MemoryProfiler(json_path=os.path.join(out_dir, "memory_profile.json"),
                              plot_path=os.path.join(out_dir, "memory_profile.png")) as prof:
            with prof.phase("step"):
                train_step(ws, x)
        cupy.cuda.runtime.deviceSynchronize()
        print(prof.report())
        return {"events": len(prof.timeline), "peak_allocated": prof.peak["allocated"],
                "by_op": prof.peak["by_op"][:8]}
    res["profile"] = guarded(profile)

    # 2. pool overhead
    def overhead():
        cupy.cuda.runtime.deviceSynchronize()
        seq = record_sequence(pool, lambda: train_step(ws, x))
        cupy.cuda.runtime.deviceSynchronize()
        us_pair, n_alloc = replay_us_per_pair(pool, seq)
        sizes = [512, 4096, 1 << 20, 64 << 20]
        flame_us = empty_del_us(cupy.cuda.using_allocator(mcuda._allocator.malloc), sizes)
        cupy_us = empty_del_us(cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc), sizes)
        cupy.get_default_memory_pool().free_all_blocks()
        return {"replay_us_per_alloc_free": us_pair, "allocs_in_step": n_alloc,
                "pool_ms_per_step": us_pair * n_alloc / 1e3,
                "cupy_empty_del_us_flame_pool": flame_us, "cupy_empty_del_us_cupy_pool": cupy_us,
                "added_over_cupy_pool_us": flame_us - cupy_us}
    res["overhead"] = guarded(overhead)
    ws = x = None  # frees them (rebound, not deleted: the closures above use the names)
    M.empty_cache()

    # PyTorch, same step, same process (FLAME's cache released)
    res["torch"] = guarded(lambda: torch_step_figures(L, W, T, args.reps))
    res["flame_step_memory"] = flame_step

    # 4. limit: the ~30 GiB step under 24 GiB, then the smaller step in the same process under the same limit
    demo = guarded(lambda: oom_demo(limit, L, args.oom_width, args.oom_tokens)) or {
        "raised": False, "report": None, "need_bytes": 0}

    def smaller_step():
        M.reset_peak_memory_stats()
        ws, x = make_mlp(L, W, T, seed=2)
        train_step(ws, x)
        cupy.cuda.runtime.deviceSynchronize()
        return M.max_memory_allocated()
    demo["smaller_step_max_allocated"] = guarded(smaller_step)
    demo["smaller_step_ran"] = demo["smaller_step_max_allocated"] is not None
    demo["limit_at_smaller_step"] = M.get_memory_limit()
    res["limit_demo"] = demo
    M.set_memory_limit(None)

    res.save()

    st, pv = res["steady_state"], res["peak_vs_driver"]
    ov = res["overhead"] or {k: float("nan") for k in ("replay_us_per_alloc_free", "pool_ms_per_step",
                                                       "allocs_in_step", "cupy_empty_del_us_flame_pool",
                                                       "cupy_empty_del_us_cupy_pool")}
    print(f"\n--- OOM report under set_memory_limit({fmt_bytes(limit)}) ---")
    print(demo["report"])
    title = f"\nFLAME memory pool: {L}-layer width-{W} bf16 MLP, {T} tokens"
    rows = [
        ("device mallocs over steady-state steps", f"{st['device_mallocs']} in {steps} steps"),
        ("allocations per step", f"{st['allocs_per_step']:.0f} "
                                                   f"(hits {st['cache_hits']}, misses {st['cache_misses']})"),
        ("step time (median, CUDA events)", f"{st['step_ms']:.2f} ms"),
        ("pool malloc+free, replayed step sequence", f"{ov['replay_us_per_alloc_free']:.2f} us/alloc"),
        ("pool time per step", f"{ov['pool_ms_per_step']:.3f} ms ({ov['allocs_in_step']} allocs)"),
        ("cupy.empty+del: FLAME pool / CuPy pool", f"{ov['cupy_empty_del_us_flame_pool']:.2f} / "
                                                    f"{ov['cupy_empty_del_us_cupy_pool']:.2f} us"),
        ("FLAME max reserved / driver used delta", f"{fmt_bytes(pv['flame_max_reserved'])} / "
                                                   f"{fmt_bytes(pv['driver_used_delta'])} = "
                                                   f"{pv['reserved_over_driver']:.4f}"),
        ("FLAME max allocated / driver used delta", f"{fmt_bytes(pv['flame_max_allocated'])} = "
                                                    f"{pv['allocated_over_driver']:.4f}"),
        ("nvidia-smi process memory before / after the cold step", " / ".join(
            "n/a" if v is None else f"{v} MiB" for v in pv["nvidia_smi_process_mib_before_after"])),
        ("FLAME step max allocated / reserved", f"{fmt_bytes(flame_step['max_allocated'])} / "
                                                f"{fmt_bytes(flame_step['max_reserved'])}"),
    ]
    if res["torch"]:
        t = res["torch"]
        rows.append(("torch step max allocated / reserved", f"{fmt_bytes(t['max_allocated'])} / "
                                                            f"{fmt_bytes(t['max_reserved'])}"))
        rows.append(("torch step time (median)", f"{t['step_ms']:.2f} ms"))
    rows += [
        ("~30 GiB model: measured need", fmt_bytes(demo["need_bytes"])),
        (f"under a {fmt_bytes(limit)} limit: OutOfMemoryError raised", str(demo["raised"])),
        ("then the 4096-wide step ran in the same process, same limit",
         f"{demo['smaller_step_ran']} (max allocated {fmt_bytes(demo['smaller_step_max_allocated'] or 0)}, "
         f"limit {fmt_bytes(demo['limit_at_smaller_step'] or 0)})"),
    ]
    print(common.table(["figure", "value"], rows, title=title))


if __name__ == "__main__":
    main()
