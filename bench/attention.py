"""Attention forward and forward+backward (bf16) at the PEERS.md shapes: FLAME's flash kernels side by side with
torch SDPA, each backend (FlashAttention-2, cuDNN, memory-efficient), in the same process.

Times are medians over repeats of CUDA-event intervals, each around `--inner` back-to-back calls (so the host's
launch overhead overlaps the GPU work, for torch and FLAME alike), after warm-up, on random normal inputs
(B, H, L, D) contiguous. FLAME runs the array level (flash_attention_forward / flash_attention_backward, kernels plus
their small launch glue). TFLOP/s counts
4 B H Lq Lk D for the forward and 3.5x that for forward+backward (as PEERS.md). "x FA2" and "x best" are torch's time
over FLAME's (above 1: FLAME is faster). Each FLAME output is checked against torch's before timing.
--tune also times the alternative tile configurations and scheduling variants; --profile runs each kernel once
between cudaProfilerStart/Stop for `ncu --profile-from-start off`. Prints the table last and writes JSON
(--out, default $OUT/attention.json or ./attention.json).
Run: PYTHONPATH=$PWD python3 bench/attention.py [--tune] [--only flux-1024]
"""
import argparse
import json
import os
import statistics

import numpy as np

SHAPES = [  # name, B, H, Lq, Lk, D
    ("flux-1024", 1, 24, 4608, 4608, 128),
    ("flux-512", 1, 24, 1536, 1536, 128),
    ("sd35-1024", 1, 38, 4250, 4250, 64),
    ("sdxl-self", 2, 10, 4096, 4096, 64),
    ("sdxl-cross", 2, 10, 4096, 77, 64),
]


INNER = 5  # calls per timed interval (--inner)


def cuda_time(fn, record, reps, warmup=5):
    """Median milliseconds per fn() call over `reps` CUDA-event intervals of INNER calls each; `record` makes
    (start, stop, elapsed) for the library."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start, stop, elapsed = record()
        start()
        for _ in range(INNER):
            fn()
        samples.append(elapsed(stop()) / INNER)
    return statistics.median(samples)


def cupy_events():
    import cupy as cp
    a, b = cp.cuda.Event(), cp.cuda.Event()

    def stop():
        b.record()
        b.synchronize()
        return b
    return a.record, stop, lambda _: cp.cuda.get_elapsed_time(a, b)


def torch_events():
    import torch
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def stop():
        b.record()
        b.synchronize()
        return b
    return a.record, stop, lambda _: a.elapsed_time(b)


def flame_case(B, H, Lq, Lk, D, reps, fwd_tiles=None, bwd_tiles=None):
    import cupy as cp
    import ml_dtypes
    from flame_core.kernels import attention as A
    rng = cp.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(s, dtype=cp.float32).astype(ml_dtypes.bfloat16) for s in
                  ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D), (B, H, Lq, D)))
    scale = 1.0 / np.sqrt(D)

    def fwd():
        return A._kernel_forward(q, k, v, None, False, scale, tiles=fwd_tiles)

    def fwd_bwd():
        o, lse = fwd()
        return A._kernel_backward(g, q, k, v, o, lse, None, False, scale, tiles=bwd_tiles)

    t_f = cuda_time(fwd, cupy_events, reps)
    t_fb = cuda_time(fwd_bwd, cupy_events, reps)
    return t_f, t_fb, (q, k, v, g), fwd(), fwd_bwd()


_PAD = {}


def gpu_ms(fn, record, memset, reps=15):
    """GPU milliseconds per call: a 1 GiB memset is queued first, so the host has launched all INNER calls before
    the first one starts and the interval holds GPU work only (the host's launch time drops out)."""
    fn()
    samples = []
    for _ in range(reps):
        memset()
        start, stop, elapsed = record()
        start()
        for _ in range(INNER):
            fn()
        samples.append(elapsed(stop()) / INNER)
    return statistics.median(samples)


def cupy_memset():
    import cupy as cp
    buf = _PAD.get("cupy")
    if buf is None:
        buf = _PAD["cupy"] = cp.empty(1 << 30, dtype=cp.uint8)
    return lambda: buf.fill(1)


def torch_memset():
    import torch
    buf = _PAD.get("torch")
    if buf is None:
        buf = _PAD["torch"] = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return lambda: buf.fill_(1)


def host_us(fn, sync, n=200):
    """Host microseconds per call: wall time of n calls queued without waiting (the GPU runs behind)."""
    import time
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    sync()
    return dt / n * 1e6


def torch_case(torch, backend, inputs, reps):
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F
    q, k, v, g = inputs
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel(backend):
            def fwd():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v)

            def fwd_bwd():
                out = F.scaled_dot_product_attention(qr, kr, vr)
                out.backward(g)
                return out
            out = fwd()
            qr.grad = kr.grad = vr.grad = None
            fwd_bwd()
            grads = (qr.grad.clone(), kr.grad.clone(), vr.grad.clone())
            t_f = cuda_time(fwd, torch_events, reps)
            t_fb = cuda_time(fwd_bwd, torch_events, reps)
        return t_f, t_fb, out, grads, None
    except Exception as e:  # a backend that does not take this shape (or crashes) is reported, not fatal
        return None, None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def profile(shapes):
    """Warm everything up, then run FLAME's forward and forward+backward and torch FA2's once each inside
    cudaProfilerStart/Stop."""
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flame_core.kernels import attention as A
    for name, B, H, Lq, Lk, D in shapes:
        _, _, inputs, _, _ = flame_case(B, H, Lq, Lk, D, 1)
        q, k, v, g = inputs
        tin = [torch.as_tensor(a.view(cp.uint16), device="cuda").view(torch.bfloat16) for a in inputs]
        qr, kr, vr = (t.detach().requires_grad_() for t in tin[:3])

        def run():
            o, lse = A._kernel_forward(q, k, v, None, False, D ** -0.5)
            A._kernel_backward(g, q, k, v, o, lse, None, False, D ** -0.5)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(qr, kr, vr).backward(tin[3])
        run()
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        run()
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        print(f"profiled {name}", flush=True)


def host_profile():
    """Host microseconds per piece of one cached forward call at the SDXL cross-attention shape (where the launch
    path, not the GPU, bounds the time)."""
    import time
    import cupy as cp
    from flame_core.kernels import attention as A
    B, H, Lq, Lk, D = 2, 10, 4096, 77, 64
    rng = cp.random.default_rng(0)
    import ml_dtypes
    q, k, v = (rng.standard_normal(s, dtype=cp.float32).astype(ml_dtypes.bfloat16) for s in
               ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D)))
    A._kernel_forward(q, k, v, None, False, D ** -0.5)
    key = next(kk for kk in A._fwd_plans if kk[0] == q.shape)
    launch, like_q, o_shape, lse_shape = A._fwd_plans[key]
    o, lse = cp.empty_like(q), cp.empty(lse_shape, dtype=cp.float32)
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr)
    pieces = {
        "key": lambda: (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, False, 0.125,
                        q.data.device_id, A.SM90_FWD),
        "ptr check": lambda: (q.data.ptr | k.data.ptr | v.data.ptr) & 15,
        "empty_like + empty": lambda: (cp.empty_like(q), cp.empty(lse_shape, dtype=cp.float32)),
        "empty_like bf16": lambda: cp.empty_like(q),
        "empty(shape, bf16)": lambda: cp.empty(o_shape, dtype=q.dtype),
        "empty(uint16).view": lambda: cp.empty(o_shape, dtype=cp.uint16).view(q.dtype),
        "ndarray(shape, bf16)": lambda: cp.ndarray(o_shape, dtype=q.dtype),
        "empty(shape, f32)": lambda: cp.empty(lse_shape, dtype=cp.float32),
        "alloc + ndarray bf16": lambda: cp.ndarray(o_shape, q.dtype, cp.cuda.alloc(q.nbytes)),
        "packed launch": lambda: launch(ptrs),
        "whole call": lambda: A._kernel_forward(q, k, v, None, False, D ** -0.5),
    }
    for name, f in pieces.items():
        n = 2000
        f()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(n):
            f()
        dt = (time.perf_counter() - t) / n * 1e6
        cp.cuda.Device().synchronize()
        print(f"  host {name:22s} {dt:7.2f} us", flush=True)


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def main():
    global INNER
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--inner", type=int, default=INNER, help="back-to-back calls per timed interval")
    ap.add_argument("--tune", action="store_true", help="also time the alternative tile configurations")
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--profile", action="store_true", help="one profiled call of each kernel (for ncu)")
    ap.add_argument("--host-profile", action="store_true", help="host time of the pieces of a forward call")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention.json"))
    args = ap.parse_args()
    INNER = args.inner
    shapes = [sh for sh in SHAPES if args.only is None or sh[0] in args.only.split(",")]
    if args.profile:
        return profile(shapes)
    if args.host_profile:
        return host_profile()

    import cupy as cp
    import torch
    from flame_core.kernels import attention as A
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [("FA2", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
                ("mem-eff", SDPBackend.EFFICIENT_ATTENTION)]
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}; torch {torch.__version__}; cupy {cp.__version__}", flush=True)

    rows, tune_rows = [], []
    for name, B, H, Lq, Lk, D in shapes:
        flops = 4.0 * B * H * Lq * Lk * D
        t_f, t_fb, inputs, (o, _), grads = flame_case(B, H, Lq, Lk, D, args.reps)
        tin = [torch.as_tensor(a.view(cp.uint16), device="cuda").view(torch.bfloat16) for a in inputs]
        tor = {}
        checks = {}
        for bname, be in backends:
            tf, tfb, tout, tgrads, err = torch_case(torch, be, tin, args.reps)
            tor[bname] = {"fwd_ms": tf, "fwd_bwd_ms": tfb, "error": err}
            if tout is not None and "ref" not in checks:  # compare FLAME with the first backend that ran
                tout_ref, tgrads_ref = tout, tgrads
                fo = torch.as_tensor(o.view(cp.uint16), device="cuda").view(torch.bfloat16)
                fg = [torch.as_tensor(x.view(cp.uint16), device="cuda").view(torch.bfloat16) for x in grads]
                checks = {"ref": bname, "o": rel(fo, tout), "dq": rel(fg[0], tgrads[0]),
                          "dk": rel(fg[1], tgrads[1]), "dv": rel(fg[2], tgrads[2])}
            print(f"  {name} torch {bname}: fwd {tf} ms, fwd+bwd {tfb} ms {err or ''}", flush=True)
        ok = [b for b in tor.values() if b["fwd_ms"]]
        best_f = min(b["fwd_ms"] for b in ok) if ok else None
        best_fb = min(b["fwd_bwd_ms"] for b in ok) if ok else None
        fa2 = tor["FA2"]
        row = {"shape": name, "B": B, "H": H, "Lq": Lq, "Lk": Lk, "D": D,
               "flame_fwd_ms": t_f, "flame_fwd_bwd_ms": t_fb,
               "flame_fwd_tflops": flops / t_f / 1e9, "flame_fwd_bwd_tflops": 3.5 * flops / t_fb / 1e9,
               "torch": tor, "best_fwd_ms": best_f, "best_fwd_bwd_ms": best_fb,
               "x_fa2_fwd": fa2["fwd_ms"] / t_f if fa2["fwd_ms"] else None,
               "x_fa2_fwd_bwd": fa2["fwd_bwd_ms"] / t_fb if fa2["fwd_bwd_ms"] else None,
               "x_best_fwd": best_f / t_f if best_f else None, "x_best_fwd_bwd": best_fb / t_fb if best_fb else None,
               "check_vs_torch": checks,
               "tiles": {"fwd": A._fwd_tiles(A._tile_dim(D), B, H, Lq, False, Lk),
                         "bwd": A.BWD_TILES[A._tile_dim(D)],
                         "sm90_bwd": A.SM90_BWD and A._tile_dim(D) in A.BWD_SM90_TILES}}
        q, k, v, _ = inputs
        row["flame_fwd_host_us"] = host_us(lambda q=q, k=k, v=v: A._kernel_forward(q, k, v, None, False, D ** -0.5),
                                           cp.cuda.Device().synchronize)
        tq, tk, tv = tin[:3]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row["torch_fa2_fwd_host_us"] = host_us(
                lambda tq=tq, tk=tk, tv=tv: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv),
                torch.cuda.synchronize)
        row["flame_fwd_gpu_ms"] = gpu_ms(lambda q=q, k=k, v=v: A._kernel_forward(q, k, v, None, False, D ** -0.5),
                                         cupy_events, cupy_memset())
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row["torch_fa2_fwd_gpu_ms"] = gpu_ms(
                lambda tq=tq, tk=tk, tv=tv: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv),
                torch_events, torch_memset())
        print(f"  {name} GPU time of the forward (host launch time excluded): FLAME {row['flame_fwd_gpu_ms']:.4f} ms,"
              f" torch FA2 {row['torch_fa2_fwd_gpu_ms']:.4f} ms", flush=True)
        gq, sc = inputs[3], D ** -0.5

        def flame_fb(q=q, k=k, v=v, gq=gq, sc=sc):
            o_, lse_ = A._kernel_forward(q, k, v, None, False, sc)
            A._kernel_backward(gq, q, k, v, o_, lse_, None, False, sc)
        row["flame_fwd_bwd_gpu_ms"] = gpu_ms(flame_fb, cupy_events, cupy_memset())
        row["flame_fwd_bwd_host_us"] = host_us(flame_fb, cp.cuda.Device().synchronize, n=100)
        tqr, tkr, tvr = (t.detach().requires_grad_() for t in (tq, tk, tv))
        tg = tin[3]

        def torch_fb(tqr=tqr, tkr=tkr, tvr=tvr, tg=tg):
            torch.nn.functional.scaled_dot_product_attention(tqr, tkr, tvr).backward(tg)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row["torch_fa2_fwd_bwd_gpu_ms"] = gpu_ms(torch_fb, torch_events, torch_memset())
            row["torch_fa2_fwd_bwd_host_us"] = host_us(torch_fb, torch.cuda.synchronize, n=100)
        print(f"  {name} fwd+bwd GPU time: FLAME {row['flame_fwd_bwd_gpu_ms']:.4f} ms, torch FA2 "
              f"{row['torch_fa2_fwd_bwd_gpu_ms']:.4f} ms; host us per fwd+bwd: FLAME "
              f"{row['flame_fwd_bwd_host_us']:.1f}, "
              f"torch FA2 {row['torch_fa2_fwd_bwd_host_us']:.1f}", flush=True)
        del tqr, tkr, tvr, tg
        row["tiles"]["sm90_fwd"] = A._use_sm90(A._tile_dim(D), None, Lk)
        rows.append(row)
        print(f"  {name} flame: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms; check {checks}; host us/call: FLAME fwd "
              f"{row['flame_fwd_host_us']:.1f}, torch FA2 fwd {row['torch_fa2_fwd_host_us']:.1f}", flush=True)
        if args.tune:
            td = A._tile_dim(D)
            cands = list(A.FWD_SM90_TILES_CANDIDATES.get(td, [])) + [A._fwd_tiles(td, B, H, Lq, False, Lk)]
            if Lk <= 128:
                cands.append((64, 64, 4, 0))
            for ft in cands:
                tf, _, _, (o2, _), _ = flame_case(B, H, Lq, Lk, D, args.reps, fwd_tiles=ft)
                err = rel(torch.as_tensor(o2.view(cp.uint16), device="cuda").view(torch.bfloat16), tout_ref)
                tune_rows.append((name, f"fwd e={err:.1e}", ft, tf))
                tg = gpu_ms(lambda q=q, k=k, v=v, ft=ft: A._kernel_forward(q, k, v, None, False, D ** -0.5, tiles=ft),
                            cupy_events, cupy_memset())
                tune_rows.append((name, "fwd GPU", ft, tg))
            alts = {64: [(128, 128, 8, 4, 4, 4, 2), (2, 2, 64), (2, 3, 64), (2, 2, 128), (2, 3, 128)],
                    128: [(64, 128, 8, 2, 4, 2, 2), (2, 2, 64), (2, 3, 64)], 256: [(64, 64, 8, 2, 4, 2, 0)]}[td]
            for bt in alts:
                _, tfb, _, _, g2 = flame_case(B, H, Lq, Lk, D, args.reps, bwd_tiles=bt)
                err = max(rel(torch.as_tensor(x.view(cp.uint16), device="cuda").view(torch.bfloat16), r)
                          for x, r in zip(g2, tgrads_ref))
                tune_rows.append((name, f"f+b e={err:.1e}", bt, tfb))
        del inputs, o, grads, tin, tq, tk, tv, q, k, v
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    with open(args.out, "w") as f:
        json.dump({"device": dev, "rows": rows, "tune": tune_rows}, f, indent=1)
    if tune_rows:
        print("\ntile tuning (ms):")
        for name, what, tiles, t in tune_rows:
            print(f"  {name:11s} {what:8s} {str(tiles):26s} {t:8.3f}")

    def f(x, fmt="{:.3f}"):
        return fmt.format(x) if x is not None else "-"
    print(f"\n{dev}, bf16, non-causal; ms (TFLOP/s); x = torch time / FLAME time")
    hdr = (f"{'shape':11s} {'pass':7s} {'FLAME':>16s} {'torch FA2':>16s} {'torch cuDNN':>16s} {'torch mem-eff':>16s}"
           f" {'x FA2':>6s} {'x best':>6s}")
    print(hdr)
    for r in rows:
        fl = 4.0 * r["B"] * r["H"] * r["Lq"] * r["Lk"] * r["D"]
        for pass_, key, mult, xf, xb in (("fwd", "fwd_ms", 1.0, "x_fa2_fwd", "x_best_fwd"),
                                         ("fwd+bwd", "fwd_bwd_ms", 3.5, "x_fa2_fwd_bwd", "x_best_fwd_bwd")):
            mine = r["flame_" + key]
            cells = [f"{mine:.3f} ({mult * fl / mine / 1e9:.0f})"]
            for b in ("FA2", "cuDNN", "mem-eff"):
                t = r["torch"][b][key]
                cells.append(f"{t:.3f} ({mult * fl / t / 1e9:.0f})" if t else "n/a")
            print(f"{r['shape']:11s} {pass_:7s} " + " ".join(f"{c:>16s}" for c in cells)
                  + f" {f(r[xf], '{:.2f}'):>6s} {f(r[xb], '{:.2f}'):>6s}")


if __name__ == "__main__":
    main()
