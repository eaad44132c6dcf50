"""Per-op host overhead: a chain of 200 small ops with requires_grad, forward + backward, in µs per op.

FLAME on cpu and (when CuPy sees a GPU) on cuda, side by side with PyTorch eager in the same process when torch is
importable. Prints a table last and writes JSON (--out, default $OUT/overhead.json or ./overhead.json).
Run: PYTHONPATH=$PWD python3 bench/overhead.py
"""
import argparse
import json
import os
import statistics
import time

import flame_core as flame

N_OPS = 200


def flame_chain(x):
    y = x
    for _ in range(N_OPS // 4):
        y = y * 1.01
        y = y + 0.5
        y = y.tanh()
        y = y - x
    return y.sum()


def time_flame(device, reps, sync):
    flame.manual_seed(0)
    x = flame.randn(16, device=device, requires_grad=True)
    for _ in range(5):
        flame_chain(x).backward()
    sync()
    samples = []
    for _ in range(reps):
        x.grad = None
        t = time.perf_counter()
        flame_chain(x).backward()
        sync()
        samples.append((time.perf_counter() - t) / N_OPS * 1e6)
    return statistics.median(samples)


def time_torch(torch, device, reps):
    x = torch.randn(16, device=device, requires_grad=True)

    def chain(x):
        y = x
        for _ in range(N_OPS // 4):
            y = y * 1.01
            y = y + 0.5
            y = y.tanh()
            y = y - x
        return y.sum()

    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    for _ in range(5):
        chain(x).backward()
    sync()
    samples = []
    for _ in range(reps):
        x.grad = None
        t = time.perf_counter()
        chain(x).backward()
        sync()
        samples.append((time.perf_counter() - t) / N_OPS * 1e6)
    return statistics.median(samples)


def time_raw_cupy(reps):
    """Diagnostic floor: the same forward chain on raw CuPy arrays (no autograd), per op."""
    import cupy
    x = cupy.random.standard_normal(16, dtype=cupy.float32)

    def chain(x):
        y = x
        for _ in range(N_OPS // 4):
            y = y * 1.01
            y = y + 0.5
            y = cupy.tanh(y)
            y = y - x
        return y.sum()

    for _ in range(5):
        chain(x)
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        chain(x)
        cupy.cuda.Device().synchronize()
        samples.append((time.perf_counter() - t) / N_OPS * 1e6)
    return statistics.median(samples)


def host_us(fn, n=2000):
    """Median host µs per fn() call over 5 batches of n calls (the GPU work is tiny; launches stay queued)."""
    for _ in range(50):
        fn()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    import cupy
    cupy.cuda.Device().synchronize()
    return statistics.median(out)


def primitives():
    """Host cost of the building blocks of one op on cuda (µs per call): where the per-op overhead goes."""
    import cupy as cp
    import numpy as np
    import flame_nn.functional as F
    from cupy.cuda import cublas, device, runtime
    from flame_core.kernels import activations as act, loader
    bf = np.dtype(flame.bfloat16.np)
    a32 = cp.random.standard_normal(16, dtype=cp.float32)
    m = cp.random.standard_normal((64, 64), dtype=cp.float32).astype(bf)
    out = cp.empty((64, 64), dtype=bf)
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    h = device.get_cublas_handle()

    def gemm():
        cublas.gemmEx(h, 1, 0, 64, 64, 64, one.ctypes.data, m.data.ptr, runtime.CUDA_R_16BF, 64, m.data.ptr,
                      runtime.CUDA_R_16BF, 64, zero.ctypes.data, out.data.ptr, runtime.CUDA_R_16BF, 64,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    t16 = flame.randn(16, device="cuda")
    tg = flame.randn(16, device="cuda", requires_grad=True)
    x = flame.randn(64, 64, device="cuda").bfloat16()
    w = flame.randn(64, 64, device="cuda").bfloat16()
    ln_w = flame.ones(64, device="cuda").bfloat16()
    rows = [
        ("cupy.empty (FLAME pool)", lambda: cp.empty((16,), cp.float32)),
        ("cupy elementwise a*1.01", lambda: a32 * 1.01),
        ("cupy.matmul 64x64 bf16", lambda: cp.matmul(m, m)),
        ("cublas.gemmEx direct 64x64 bf16", gemm),
        ("raw kernel: silu via loader", lambda: act.silu_forward(a32)),
        ("flame t*1.01, no grad", lambda: t16 * 1.01),
        ("flame t*1.01, recorded", lambda: tg * 1.01),
        ("flame linear 64x64 bf16", lambda: F.linear(x, w)),
        ("flame layer_norm 64x64 bf16", lambda: F.layer_norm(x, (64,), ln_w, None)),
    ]
    res = {}
    print(f"{'primitive (cuda, host us/call)':36s} {'us':>8s}")
    for name, fn in rows:
        with flame.no_grad() if "no grad" in name or "linear" in name or "layer_norm" in name else _null():
            us = host_us(fn)
        res[name] = us
        print(f"{name:36s} {us:8.2f}")
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "overhead.json"))
    args = ap.parse_args()
    rows = []
    rows.append(("cpu", time_flame("cpu", args.reps, lambda: None)))
    cuda = flame.cuda_is_available()
    if cuda:
        import cupy
        rows.append(("cuda", time_flame("cuda", args.reps, lambda: cupy.cuda.Device().synchronize())))
    peers = {}
    try:
        import torch
        peers["cpu"] = time_torch(torch, "cpu", args.reps)
        if torch.cuda.is_available():
            peers["cuda"] = time_torch(torch, "cuda", args.reps)
    except ImportError:
        pass
    result = []
    print(f"{'device':8s} {'flame us/op':>12s} {'torch us/op':>12s} {'ratio':>8s}")
    for dev, us in rows:
        p = peers.get(dev)
        ratio = us / p if p else None
        result.append({"device": dev, "flame_us_per_op": us, "torch_us_per_op": p, "ratio": ratio})
        print(f"{dev:8s} {us:12.2f} {p if p else float('nan'):12.2f} {ratio if ratio else float('nan'):8.2f}")
    raw = time_raw_cupy(args.reps) if cuda else None
    prims = primitives() if cuda else None
    if raw is not None:
        print(f"(diagnostic: raw CuPy forward-only chain, no autograd: {raw:.2f} us/op)")
    with open(args.out, "w") as f:
        json.dump({"n_ops": N_OPS, "rows": result, "raw_cupy_forward_us_per_op": raw, "primitives_us": prims},
                  f, indent=1)


if __name__ == "__main__":
    main()
