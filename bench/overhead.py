"""Per-op host overhead: a chain of 200 small ops with requires_grad, forward + backward, in µs per op.

FLAME on cpu and (when CuPy sees a GPU) on cuda, side by side with PyTorch eager in the same process when torch is
importable (torch's cpu is the peer on cpu, torch's cuda on cuda; without torch FLAME is timed alone). Prints a table
last and writes JSON (--out, default $OUT/overhead.json or ./overhead.json).

What is timed: the wall-clock time of one whole chain -- 200 ops on a 16-element float32 tensor, forward and
backward -- ended by a device synchronize on cuda, divided by 200. The tensors are tiny, so the GPU is idle and the
figure is the host's cost of issuing an op and its backward (Python, array library, driver launches): the op-overhead
question, not kernel speed.

Protocol (robust to host drift: a lent VM's host speed moves by 30 % between and within processes): interleaved A/B.
`--rounds` rounds (default 15); a round is one FLAME trial and one torch trial, FLAME first in even rounds and torch
first in odd ones; a trial is the median of `--chains` consecutive chains (default 5). Reported per device: the median
over rounds of each framework's µs/op, the median of the per-round ratios FLAME/torch (the figure to quote: both
sides of a ratio ran within a few milliseconds of each other, so a drift of the host cancels), and that ratio's
spread over the rounds (min, quartiles, max).
Run: PYTHONPATH=$PWD python3 bench/overhead.py [--rounds 15] [--chains 5] [--device all|cpu|cuda] [--no-primitives]
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


def torch_chain(x):
    y = x
    for _ in range(N_OPS // 4):
        y = y * 1.01
        y = y + 0.5
        y = y.tanh()
        y = y - x
    return y.sum()


def _trial(chain, x, sync, chains):
    """Median µs/op over `chains` consecutive chains (forward + backward, synchronized)."""
    out = []
    for _ in range(chains):
        x.grad = None
        t = time.perf_counter()
        chain(x).backward()
        sync()
        out.append((time.perf_counter() - t) / N_OPS * 1e6)
    return statistics.median(out)


def _flame_side(device):
    flame.manual_seed(0)
    x = flame.randn(16, device=device, requires_grad=True)
    if device == "cuda":
        import cupy
        sync = cupy.cuda.Device().synchronize
    else:
        def sync():
            pass
    return x, sync


def _torch_side(torch, device):
    torch.manual_seed(0)
    x = torch.randn(16, device=device, requires_grad=True)
    if device == "cuda":
        sync = torch.cuda.synchronize
    else:
        def sync():
            pass
    return x, sync


def _spread(values):
    v = sorted(values)
    if len(v) >= 2:
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    else:
        q1 = q3 = v[0]
    return {"min": v[0], "q1": q1, "median": statistics.median(v), "q3": q3, "max": v[-1]}


def interleaved(device, torch, rounds, chains, warmup=5):
    """The A/B protocol of the docstring on one device; torch=None times FLAME alone."""
    fx, fsync = _flame_side(device)
    sides = [("flame", flame_chain, fx, fsync)]
    if torch is not None:
        tx, tsync = _torch_side(torch, device)
        sides.append(("torch", torch_chain, tx, tsync))
    for _, chain, x, sync in sides:  # warm-up: kernel compilation, caches, the memory pools' free lists
        for _ in range(warmup):
            x.grad = None
            chain(x).backward()
        sync()
    per = {name: [] for name, *_ in sides}
    for r in range(rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for name, chain, x, sync in order:
            per[name].append(_trial(chain, x, sync, chains))
    row = {"device": device, "flame_us_per_op": statistics.median(per["flame"]), "torch_us_per_op": None,
           "ratio": None, "ratio_of_medians": None, "ratio_spread": None, "flame_spread": _spread(per["flame"]),
           "torch_spread": None, "rounds": rounds, "chains_per_trial": chains, "flame_rounds": per["flame"],
           "torch_rounds": None}
    if torch is not None:
        ratios = [f / t for f, t in zip(per["flame"], per["torch"])]
        row.update(torch_us_per_op=statistics.median(per["torch"]), ratio=statistics.median(ratios),
                   ratio_spread=_spread(ratios), torch_spread=_spread(per["torch"]), torch_rounds=per["torch"],
                   ratio_rounds=ratios)
        row["ratio_of_medians"] = row["flame_us_per_op"] / row["torch_us_per_op"]
    return row


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
    from flame_core.kernels import activations as act
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
    ap.add_argument("--rounds", type=int, default=15, help="A/B rounds per device (one FLAME and one torch trial each)")
    ap.add_argument("--chains", type=int, default=5, help="chains per trial (a trial's figure is their median)")
    ap.add_argument("--reps", type=int, default=30, help="repetitions of the raw CuPy and primitive diagnostics")
    ap.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    ap.add_argument("--no-torch", action="store_true", help="time FLAME alone even when torch is importable")
    ap.add_argument("--no-primitives", action="store_true", help="skip the cuda diagnostics (raw CuPy, primitives)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "overhead.json"))
    args = ap.parse_args()
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    cuda = flame.cuda_is_available()
    devices = [d for d in ("cpu", "cuda") if args.device in ("all", d) and (d == "cpu" or cuda)]
    result = []
    for dev in devices:
        peer = torch if torch is not None and (dev == "cpu" or torch.cuda.is_available()) else None
        result.append(interleaved(dev, peer, args.rounds, args.chains))
    raw = time_raw_cupy(args.reps) if cuda and "cuda" in devices and not args.no_primitives else None
    prims = primitives() if cuda and "cuda" in devices and not args.no_primitives else None
    if raw is not None:
        print(f"(diagnostic: raw CuPy forward-only chain, no autograd: {raw:.2f} us/op)")
    nan = float("nan")
    print(f"\n{N_OPS}-op chain, forward + backward, us/op; interleaved A/B, {args.rounds} rounds x "
          f"{args.chains} chains; ratio = median of per-round FLAME/torch ratios [min, q1-q3, max]")
    print(f"{'device':8s} {'flame us/op':>12s} {'torch us/op':>12s} {'ratio':>8s}   {'ratio spread':s}")
    for r in result:
        sp = r["ratio_spread"]
        spread = f"[{sp['min']:.2f}, {sp['q1']:.2f}-{sp['q3']:.2f}, {sp['max']:.2f}]" if sp else "(no torch)"
        t, q = r["torch_us_per_op"], r["ratio"]
        print(f"{r['device']:8s} {r['flame_us_per_op']:12.2f} {t if t else nan:12.2f} {q if q else nan:8.2f}   "
              f"{spread}")
    with open(args.out, "w") as f:
        json.dump({"n_ops": N_OPS, "protocol": "interleaved A/B", "rounds": args.rounds, "chains_per_trial":
                   args.chains, "torch_version": getattr(torch, "__version__", None), "rows": result,
                   "raw_cupy_forward_us_per_op": raw, "primitives_us": prims}, f, indent=1)


if __name__ == "__main__":
    main()
