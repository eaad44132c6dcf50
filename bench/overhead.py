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
    if raw is not None:
        print(f"(diagnostic: raw CuPy forward-only chain, no autograd: {raw:.2f} us/op)")
    with open(args.out, "w") as f:
        json.dump({"n_ops": N_OPS, "rows": result, "raw_cupy_forward_us_per_op": raw}, f, indent=1)


if __name__ == "__main__":
    main()
