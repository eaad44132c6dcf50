# One-off device probe of 2026-12-04 (issue 48, the eager GEMM path): kept in history for BENCHMARKS, removed in the next commit.
import cProfile, pstats, io, statistics, time, ctypes
import cupy as cp
import flame_core as flame
import flame_nn.functional as F
from flame_core.kernels import gemm

def per_call(fn, n=2000, rep=7, sync=None):
    out = []
    for _ in range(rep):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if sync: sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)
S = cp.cuda.Device().synchronize
fd = flame.bfloat16
x = flame.randn(16, 64, device="cuda").to(fd); w = flame.randn(64, 64, device="cuda").to(fd)
def prof(fn, n, title):
    for _ in range(20): fn()
    S()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): fn()
    S(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    print(f"\n##### {title}\n" + "\n".join(s.getvalue().splitlines()[:45]))
with flame.no_grad():
    prof(lambda: x @ w, 3000, "x @ w no_grad")
xr = flame.randn(16, 64, device="cuda").to(fd).requires_grad_()
ws = [(flame.randn(64, 64, device="cuda").to(fd) * 0.1).requires_grad_() for _ in range(25)]
bs = [flame.randn(64, device="cuda").to(fd).requires_grad_() for _ in range(25)]
def fchain():
    y = xr
    for i in range(25):
        y = F.linear(y, ws[i], bs[i]).tanh()
    y.sum().backward()
prof(fchain, 100, "chain linear bias + tanh, fwd+bwd, 100 chains")
# alternatives
from cupy_backends.cuda.libs import cublas as cb
a_, b_ = x._data, w._data.T
out = cp.empty((16, 64), dtype=a_.dtype)
h = cp.cuda.device.get_cublas_handle()
one = ctypes.c_float(1.0); zero = ctypes.c_float(0.0)
pa, pb, po = a_.data.ptr, b_.data.ptr, out.data.ptr
cb.setPointerMode(h, 0)
try:
    print("cython gemmEx", per_call(lambda: cb.gemmEx(h, 1, 0, 64, 16, 64, ctypes.addressof(one), pb, 14, 64, pa, 14, 64, ctypes.addressof(zero), po, 14, 64, 68, -1), sync=S))
except Exception as e:
    print("cython gemmEx failed", e)
lib, hh = gemm._handle()
o1, z1 = ctypes.byref(one), ctypes.byref(zero)
print("ctypes gemmEx", per_call(lambda: lib.cublasGemmEx(hh, 1, 0, 64, 16, 64, o1, pb, 14, 64, pa, 14, 64, z1, po, 14, 64, 68, -1), sync=S))
print("ctypes gemmEx algo 99 (TENSOR_OP default)", per_call(lambda: lib.cublasGemmEx(hh, 1, 0, 64, 16, 64, o1, pb, 14, 64, pa, 14, 64, z1, po, 14, 64, 68, 99), sync=S))
f32 = cp.random.randn(16, 64).astype(cp.float32); w32 = cp.random.randn(64, 64).astype(cp.float32); o32 = cp.empty((16, 64), cp.float32)
print("ctypes sgemm-via-GemmEx f32", per_call(lambda: lib.cublasGemmEx(hh, 0, 0, 64, 16, 64, o1, w32.data.ptr, 0, 64, f32.data.ptr, 0, 64, z1, o32.data.ptr, 0, 64, 68, -1), sync=S))
lib.cublasSgemm_v2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
print("ctypes Sgemm f32", per_call(lambda: lib.cublasSgemm_v2(hh, 0, 0, 64, 16, 64, o1, w32.data.ptr, 64, f32.data.ptr, 64, z1, o32.data.ptr, 64), sync=S))
noop = ctypes.CDLL(None).getpid
print("ctypes getpid (0 args)", per_call(noop))
g = cp.random.randn(16, 64).astype(cp.float32).astype(a_.dtype)
print("cupy sum(0) bf16", per_call(lambda: g.sum(0), sync=S))
print("cupy sum(0, dtype=f32)", per_call(lambda: g.sum(0, dtype=cp.float32), sync=S))
ones = cp.ones((1, 16), dtype=a_.dtype)
print("gemm ones@g", per_call(lambda: gemm.matmul(ones, g), sync=S))
from flame_core.kernels import gemm_lt
print("gemm_lt.linear_bias arrays", per_call(lambda: gemm_lt.linear_bias(a_, w._data, g[0]), sync=S))
