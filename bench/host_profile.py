"""Where the host time of one small op goes on cuda: cProfile of N calls of each primitive (tiny tensors, so the
GPU is idle and every microsecond is Python / CuPy / driver overhead). Diagnostic for per-op overhead work.
Run: PYTHONPATH=$PWD python3 bench/host_profile.py [--n 3000] [--top 18] [--chain]
--chain: bench/overhead.py's chain (200 ops, forward + backward) split into its parts -- forward without grad,
forward recorded, forward + backward, the same with the garbage collector off -- then a cProfile of the whole
chain. It runs on FLAME's default device: `FLAME_DEVICE=cpu` profiles the NumPy path (no GPU needed).
"""
import argparse
import cProfile
import io
import pstats
import time

import flame_core as flame
import flame_nn.functional as F
from flame_core.kernels import activations as act


def chain_parts(top):
    import gc
    import statistics
    import overhead  # bench/overhead.py
    n_ops = overhead.N_OPS
    device = flame.default_device()
    cuda = device.type == "cuda"
    if cuda:
        import cupy as cp
        sync = cp.cuda.Device().synchronize
    else:
        def sync():
            pass
    x = flame.randn(16, device=device, requires_grad=True)

    def timed(fn, reps=30):
        for _ in range(5):
            fn()
        sync()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - t) / n_ops * 1e6)
        return statistics.median(out)

    def fwd_nograd():
        with flame.no_grad():
            overhead.flame_chain(x)

    def fwd():
        overhead.flame_chain(x)

    def full():
        x.grad = None
        overhead.flame_chain(x).backward()
    rows = [("forward, no grad", timed(fwd_nograd)), ("forward, recorded", timed(fwd)),
            ("forward + backward", timed(full))]
    gc.disable()
    rows.append(("forward + backward, gc off", timed(full)))
    gc.enable()
    rows.append(("backward alone (fwd+bwd - fwd recorded)", rows[2][1] - rows[1][1]))
    if cuda:
        rows.append(("raw CuPy forward (diagnostic)", overhead.time_raw_cupy(30)))
    print(f"\n== bench/overhead.py chain on {device}, us per op")
    for name, us in rows:
        print(f"{name:40s} {us:8.2f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        full()
    prof.disable()
    sync()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()][4:]
        print(f"\n== chain, 20 x (200 ops + backward), top by {key}")
        print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--chain", action="store_true")
    a = ap.parse_args()
    if a.chain:
        return chain_parts(max(a.top, 35))
    import cupy as cp
    x32 = cp.random.standard_normal(16, dtype=cp.float32)
    x = flame.randn(64, 64, device="cuda").bfloat16()
    w = flame.randn(64, 64, device="cuda").bfloat16()
    lw = flame.ones(64, device="cuda").bfloat16()
    tg = flame.randn(16, device="cuda", requires_grad=True)

    def chain_bwd():
        (tg * 1.01).sum().backward()
    cases = [("raw silu kernel (flame_core.kernels)", lambda: act.silu_forward(x32)),
             ("layer_norm bf16 64x64", lambda: F.layer_norm(x, (64,), lw, None)),
             ("linear bf16 64x64", lambda: F.linear(x, w)),
             ("mul + sum + backward (recorded)", chain_bwd)]
    for name, fn in cases:
        ctx = flame.no_grad() if "recorded" not in name else flame.enable_grad()
        with ctx:
            for _ in range(50):
                fn()
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            for _ in range(a.n):
                fn()
            us = (time.perf_counter() - t) / a.n * 1e6
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.n):
                fn()
            prof.disable()
        cp.cuda.Device().synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.top)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()][4:]
        print(f"\n== {name}: {us:.1f} us/call unprofiled; top by own time over {a.n} calls", flush=True)
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
