"""Probe: SiLU / GELU(tanh) backward at 4608x12288 bf16 with 8-byte vectors (bench/probes/act_bwd_v8.cu) against
the library's 16-byte kernels (their default plans and the best of kernel_sweep actgrid) and torch, in 9 interleaved
rounds (medians, x torch), each variant checked against the library's output. Same protocol as bench/kernels.py.
Run: PYTHONPATH=$PWD python3 bench/act_probe.py"""
import pathlib
import statistics
import sys

sys.path.insert(0, "bench")
sys.argv = sys.argv[:1]
import kernels as B  # noqa: E402
import numpy as np  # noqa: E402
from flame_core.kernels import activations as A, loader as L  # noqa: E402

cp, F = B.cp, B.F


def main(rounds=9):
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    n = x.size
    src = L.source("activations") + (pathlib.Path(__file__).parent / "probes" / "act_bwd_v8.cu").read_text()
    plans = [(u, blk) for u in (1, 2, 4) for blk in (128, 256, 512)]
    names = [f"{k}_bwd_v8<__nv_bfloat16, {u}>" for k in ("silu", "gelu") for u in (1, 2, 4)]
    mod = cp.RawModule(code=src, options=L.NVRTC_OPTIONS, name_expressions=names)
    out = cp.empty_like(x)
    ops = {"silu bwd": ("silu", lambda: A.silu_backward(dy, x), B._torch_bwd(F.silu, x, dy), (1, 512)),
           "gelu(tanh) bwd": ("gelu", lambda: A.gelu_backward(dy, x, "tanh"),
                              B._torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy), (1, 256))}
    for label, (stem, lib, tor, alt) in ops.items():
        want = lib()
        cands = {"library default": lib}

        def lib_alt(alt=alt, lib=lib):
            A.plan_override = alt
            try:
                return lib()
            finally:
                A.plan_override = None
        cands[f"library {alt}"] = lib_alt
        for u, blk in plans:
            k = mod.get_function(f"{stem}_bwd_v8<__nv_bfloat16, {u}>")
            grid = (L.cdiv(n // 4, blk * u),)
            cands[f"8-byte ({u}, {blk})"] = (lambda k=k, grid=grid, blk=blk:
                                             k(grid, (blk,), (dy, x, out, np.int64(n))) or out)
        for name, fn in cands.items():
            got = fn()
            err = float(cp.abs(got.astype(np.float32) - want.astype(np.float32)).max())
            assert err <= 0.02 * float(cp.abs(want.astype(np.float32)).max()), (label, name, err)
        times = {c: [] for c in list(cands) + ["torch"]}
        for _ in range(rounds):
            for c, fn in cands.items():
                times[c].append(B.time_ms(fn))
            times["torch"].append(B.time_ms(tor, torch_op=True))
        mt = statistics.median(times["torch"])
        print(f"== {label}, median of {rounds} interleaved rounds (ms), fastest first")
        for c in sorted(times, key=lambda c: statistics.median(times[c])):
            t = statistics.median(times[c])
            print(f"  {c:22s} {t:.4f}  x torch {mt / t:.4f}", flush=True)


if __name__ == "__main__":
    main()
