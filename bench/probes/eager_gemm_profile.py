# One-off device probe of 2026-12-04 (issue 48, the eager GEMM path): kept in history for BENCHMARKS, removed in the next commit.
import cProfile, pstats, io, statistics, time, ctypes, sys
import numpy as np, cupy as cp
sys.path.insert(0, "bench")
import flame_core as flame
from flame_core.kernels import gemm, gemm_lt
S = cp.cuda.Device().synchronize
def per_call(fn, n=2000, rep=7):
    out = []
    for _ in range(rep):
        t = time.perf_counter()
        for _ in range(n): fn()
        S(); out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)
# (a) concurrent streams, synced inputs
rng = np.random.default_rng(5)
a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 80)).astype(np.float32)
A, B = cp.asarray(a), cp.asarray(b); S()
s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
bad = 0
for trial in range(50):
    outs = []
    for k in range(6):
        with (s1 if k % 2 else s2):
            outs.append(gemm.matmul(A, B))
    S()
    bad += sum(not np.allclose(cp.asnumpy(o), a @ b, rtol=1e-4, atol=1e-4) for o in outs)
print("\nconcurrent two-stream products wrong:", bad, "of 300")
# (b) GemmEx vs Lt kept plan, 16x64 @ 64x64 bf16
x = cp.asarray(rng.standard_normal((16, 64))).astype(gemm.BF16); w = cp.asarray(rng.standard_normal((64, 64))).astype(gemm.BF16)
bias = cp.zeros(64, gemm.BF16)
lib, h = gemm._handle()
out = cp.empty((16, 64), gemm.BF16)
o1, z1 = ctypes.byref(gemm._ONE), ctypes.byref(gemm._ZERO)
pa, pb, po = x.data.ptr, w.data.ptr, out.data.ptr
print("GemmEx own handle bf16", per_call(lambda: lib.cublasGemmEx(h, 1, 0, 64, 16, 64, o1, pb, 14, 64, pa, 14, 64, z1, po, 14, 64, 68, -1)))
print("gemm.matmul(x, w.T)", per_call(lambda: gemm.matmul(x, w.T)))
print("gemm_lt.linear_bias", per_call(lambda: gemm_lt.linear_bias(x, w, bias)))
hl = gemm_lt._handles[cp.cuda.runtime.getDevice()]
plan = next(p for k, p in gemm_lt._plans.items() if p is not None)
ws = gemm.workspace().data.ptr
print("_matmul Lt kept plan", per_call(lambda: gemm_lt._matmul(plan, hl, pb, pa, po, bias.data.ptr, ws)))
# (c) cProfile of the overhead linear chain, forward and backward
import overhead
side = overhead._flame_side("cuda", "linear")
_, xx, sync, run, params = side
for _ in range(5):
    for p in params: p.grad = None
    run(xx).backward()
S()
pr = cProfile.Profile()
ys = []
for _ in range(20):
    for p in params: p.grad = None
    pr.enable(); y = run(xx); S(); pr.disable()
    ys.append(y)
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print("\n##### forward\n" + "\n".join(s.getvalue().splitlines()[:40]))
pr = cProfile.Profile()
for y in ys:
    pr.enable(); y.backward(); S(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print("\n##### backward\n" + "\n".join(s.getvalue().splitlines()[:40]))
