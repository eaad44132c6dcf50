"""Small GEMMs: FLAME's own kernel (cuda_src/gemm_small.cu) against cuBLAS / cuBLASLt and torch, per problem size.

For each (M, N, K) up to the path's bounds (flame_core.kernels.gemm_small: MAX_DIM, MAX_MACS), a linear layer's
forward y = x W^T + b and its backward (dx, dW, db) on float32 / bfloat16 cuda arrays:
- GPU µs per call: back-to-back calls between CUDA events, queued behind a busy GPU (common.busy_gpu) so the interval
  holds the GPU's work alone -- what a CUDA graph replay of the call costs, where no host cost is paid;
- host µs per call: calls issued without waiting (common.host_us) -- what an eager call costs.
Sides: `small` (gemm_small.linear / linear_grads: one launch each), `cublas` (gemm_lt.linear_bias for the forward;
gemm.matmul for dx and gemm_lt.weight_bias_grad for dW and db), and torch (F.linear's addmm; mm, mm and sum), in
one process. The bounds are right where `small`'s GPU time stays within a few microseconds of cuBLAS's while its host
time is far below it.
Run: PYTHONPATH=$PWD python3 bench/small_gemm.py [--dtypes float32,bfloat16] [--shapes 16x64x512,...]
     [--max-dim 512 --max-macs 8388608]  (raise the path's bounds for this run: to measure sizes past them)
"""
import argparse

import common
import numpy as np

SHAPES = ((16, 64, 64), (1, 128, 128), (64, 128, 128), (128, 128, 64), (128, 64, 128), (8, 128, 128), (128, 8, 128),
          (32, 128, 32))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="MxNxK,...")
    ap.add_argument("--max-dim", type=int, help="the small path's MAX_DIM for this run")
    ap.add_argument("--max-macs", type=int, help="the small path's MAX_MACS for this run")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        ap.error(f"--shapes: each entry is MxNxK with positive sides, got {args.shapes!r}")
    import cupy as cp

    from flame_core.kernels import gemm, gemm_lt
    from flame_core.kernels import gemm_small as GS
    if args.max_dim is not None:
        GS.MAX_DIM = args.max_dim
    if args.max_macs is not None:
        GS.MAX_MACS = args.max_macs
    torch = common.import_torch()
    res = common.Results("small_gemm")
    rows = []
    rng = np.random.default_rng(0)
    for dtn in args.dtypes.split(","):
        dt = GS._DTYPES[{"float32": 0, "float16": 1, "bfloat16": 2}[dtn]]
        for m, n, k in shapes:
            x = cp.asarray(rng.standard_normal((m, k))).astype(dt)
            w = cp.asarray(rng.standard_normal((n, k))).astype(dt)
            b = cp.asarray(rng.standard_normal(n)).astype(dt)
            g = cp.asarray(rng.standard_normal((m, n))).astype(dt)
            assert GS.linear(x, w, b) is not None and GS.linear_grads(g, x, w, True, True, True) is not None, \
                f"{(m, n, k)} is not within the small path's bounds"
            sides = {"small": (lambda: GS.linear(x, w, b), lambda: GS.linear_grads(g, x, w, True, True, True)),
                     "cublas": (lambda: gemm_lt.linear_bias(x, w, b),
                                lambda: (gemm.matmul(g, w), gemm_lt.weight_bias_grad(g, x)))}
            if torch is not None:
                tdt = getattr(torch, dtn)
                tx, tw, tb, tg = (torch.as_tensor(a.astype(np.float32).get(), device="cuda").to(tdt)
                                  for a in (x, w, b, g))
                sides["torch"] = (lambda: torch.nn.functional.linear(tx, tw, tb),
                                  lambda: (tg @ tw, tg.t() @ tx, tg.sum(0)))
            row = [dtn, f"{m}x{n}x{k}"]
            for name, (fwd, bwd) in sides.items():
                lib = "torch" if name == "torch" else "cupy"
                busy = common.busy_gpu(lib)
                for part, fn in (("fwd", fwd), ("bwd", bwd)):
                    # ~10 ms of memsets ahead of 100 calls: the GPU is still busy when the host has issued them all
                    gpu = common.cuda_ms(fn, repeats=5, lib=lib, inner=100,
                                         before=lambda: [busy() for _ in range(30)])[0]
                    host = common.host_us(fn, lib=lib, n=500)
                    res.log(f"{dtn} {m}x{n}x{k} {name} {part}", {"gpu_us": round(gpu * 1e3, 2),
                                                                    "host_us": round(host, 2)})
                    row.append(f"{gpu * 1e3:.1f}/{host:.1f}")
            rows.append(row)
    header = ["dtype", "MxNxK"] + [f"{s} {p} gpu/host us" for s in ("small", "cublas", "torch") for p in ("fwd", "bwd")]
    print(common.table(header[:len(rows[0])], rows, title="small GEMMs: GPU us per call (busy GPU) / host us per call"))
    res.save()


if __name__ == "__main__":
    main()
