# One-off device probe of 2026-12-04 (issue 48, the eager GEMM path): kept in history for BENCHMARKS, removed in the next commit.
"""Probe: eager matmul / linear host cost, FLAME vs torch, and gemm.matmul's parts (wall µs per call, median of 7x2000)."""
import statistics, time, ctypes
import numpy as np
import cupy as cp
import torch
import flame_core as flame
import flame_nn.functional as F
from flame_core.kernels import gemm, gemm_lt

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
TS = torch.cuda.synchronize
for dt_name in ("float32", "bfloat16"):
    print(f"\n== {dt_name}")
    fd = getattr(flame, dt_name); td = getattr(torch, dt_name)
    x = flame.randn(16, 64, device="cuda").to(fd); w = flame.randn(64, 64, device="cuda").to(fd); b = flame.randn(64, device="cuda").to(fd)
    tx = torch.randn(16, 64, device="cuda", dtype=td); tw = torch.randn(64, 64, device="cuda", dtype=td); tb = torch.randn(64, device="cuda", dtype=td)
    a_, b_ = x._data, w._data.T
    with flame.no_grad(), torch.no_grad():
        for name, f, t in [("x @ w", lambda: x @ w, lambda: tx @ tw),
                           ("linear nobias", lambda: F.linear(x, w), lambda: torch.nn.functional.linear(tx, tw)),
                           ("linear bias", lambda: F.linear(x, w, b), lambda: torch.nn.functional.linear(tx, tw, tb))]:
            for _ in range(3):
                ff = per_call(f, sync=S); tt = per_call(t, sync=TS)
            print(f"{name:16s} flame {ff:6.2f}  torch {tt:6.2f}  ratio {ff/tt:.2f}")
    print("gemm.matmul arrays", per_call(lambda: gemm.matmul(a_, b_), sync=S))
    print("gemm._handle", per_call(gemm._handle))
    lib, h = gemm._handle()
    print("SetStream", per_call(lambda: lib.cublasSetStream_v2(h, cp.cuda.get_current_stream().ptr)))
    print("SetPointerMode", per_call(lambda: lib.cublasSetPointerMode_v2(h, 0)))
    out = cp.empty((16, 64), dtype=a_.dtype)
    t = gemm._CUDA_TYPE[a_.dtype]
    pa, pb, po = a_.data.ptr, b_.data.ptr, out.data.ptr
    one, zero = ctypes.byref(gemm._ONE), ctypes.byref(gemm._ZERO)
    print("GemmEx ctypes", per_call(lambda: lib.cublasGemmEx(h, 1, 0, 64, 16, 64, one, pb, t, 64, pa, t, 64, zero, po, t, 64, 68, -1), sync=S))
    print("cp.empty", per_call(lambda: cp.empty((16, 64), dtype=a_.dtype)))
    print("_prepare x2", per_call(lambda: (gemm._prepare(a_, 0), gemm._prepare(b_, 0))))
    print("get_cublas_handle", per_call(cp.cuda.device.get_cublas_handle))
    print("torch empty", per_call(lambda: torch.empty((16, 64), device="cuda", dtype=td)))
    # train chain: 25 x (linear bias -> tanh) fwd+bwd
    xr = flame.randn(16, 64, device="cuda").to(fd).requires_grad_()
    ws = [(flame.randn(64, 64, device="cuda").to(fd) * 0.1).requires_grad_() for _ in range(25)]
    bs = [flame.randn(64, device="cuda").to(fd).requires_grad_() for _ in range(25)]
    txr = torch.randn(16, 64, device="cuda", dtype=td, requires_grad=True)
    tws = [(torch.randn(64, 64, device="cuda", dtype=td) * 0.1).requires_grad_() for _ in range(25)]
    tbs = [torch.randn(64, device="cuda", dtype=td, requires_grad=True) for _ in range(25)]
    def fchain(lin, x, ws, bs, nobias=False):
        y = x
        for i in range(25):
            y = lin(y, ws[i], None if nobias else bs[i]).tanh()
        y.sum().backward()
    for nobias in (False, True):
        fr, tr = [], []
        for r in range(15):
            fr.append(per_call(lambda: fchain(F.linear, xr, ws, bs, nobias), n=20, rep=3, sync=S) / 50)
            tr.append(per_call(lambda: fchain(torch.nn.functional.linear, txr, tws, tbs, nobias), n=20, rep=3, sync=TS) / 50)
        print(f"chain linear{'(nobias)' if nobias else '(bias)'}+tanh fwd+bwd us/op: flame {statistics.median(fr):.2f} torch {statistics.median(tr):.2f} ratio {statistics.median([a/b for a,b in zip(fr,tr)]):.2f}")
