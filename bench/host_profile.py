"""Where the host time of one small op goes on cuda: cProfile of N calls of each primitive (tiny tensors, so the
GPU is idle and every microsecond is Python / CuPy / driver overhead). Diagnostic for per-op overhead work.
Run: PYTHONPATH=$PWD python3 bench/host_profile.py [--n 3000] [--top 18]
"""
import argparse
import cProfile
import io
import pstats
import time

import flame_core as flame
import flame_nn.functional as F
from flame_core.kernels import activations as act


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
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
