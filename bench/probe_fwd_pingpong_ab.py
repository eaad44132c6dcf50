"""Probe (one-off, removed after its run; kept in git history): the sm90 forward with and without the warpgroup ping-pong
at Flux / SD3.5 / SDXL shapes (fwd ms, outputs bit-equal). Run: PYTHONPATH=$PWD python3 bench/probe_fwd_pingpong_ab.py"""
import sys

sys.path.insert(0, "bench")
import common
import cupy as cp
import ml_dtypes
import numpy as np

from flame_core.kernels import attention as A

SH = [("flux-1024", 1, 24, 4608, 128), ("sd35-1024", 1, 38, 4250, 64), ("sdxl-self", 2, 10, 4096, 64),
      ("flux-512", 1, 24, 1536, 128)]
for name, B, H, L, D in SH:
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    sc = 1 / np.sqrt(D)
    res = {}
    for pp in (False, True, False, True):
        A.SM90_FWD_PINGPONG = pp
        f = lambda: A._kernel_forward(q, k, v, None, False, sc)
        o, lse = f()
        ms = common.cuda_ms(f, 25, 5, inner=5)[0]
        res.setdefault(pp, []).append((ms, o.astype(cp.float32), lse))
    same = bool(cp.array_equal(res[True][0][1], res[False][0][1]) and cp.array_equal(res[True][0][2], res[False][0][2]))
    print(f"{name}: off {[round(r[0], 4) for r in res[False]]} ms, pingpong {[round(r[0], 4) for r in res[True]]} ms, "
          f"outputs bit-equal {same}", flush=True)
A.SM90_FWD_PINGPONG = True
