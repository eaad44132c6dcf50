"""Probe: where a block of the bulk-copy norm backward (norm_bwd_tma) spends its time, from timers read by thread 0
of each block (bench/probes/norm_bwd_trace.cu: the body of the row loop 0 (weight through L1) at 96 registers, with
clock64 / globaltimer reads), 4608x3072 bf16, the library's plan for that loop and cap (norms.bwd_tma_loop = 0,
bwd_tma_regs = 96, set while the probe runs). Prints the traced kernel's time beside the library kernel's
(what the timers cost), for the library's defaults of norms.bwd_tma_early / bwd_tma_one_barrier and for (1, True),
then for the last timed call: when the blocks start, when their first row arrives, when
they end (by rows per block), and the split of a block's cycles: waiting for rows, pass 1, the block reduction,
pass 2, the part rows. Same protocol as bench/kernels.py. Run: PYTHONPATH=$PWD python3 bench/norm_trace_probe.py"""
import pathlib
import sys

sys.path.insert(0, "bench")
sys.argv = sys.argv[:1]
import kernels as B  # noqa: E402
import numpy as np  # noqa: E402
from flame_core.kernels import loader as L, norms as K  # noqa: E402

cp = B.cp
_SRC = L.source("norms") + (pathlib.Path(__file__).parent / "probes" / "norm_bwd_trace.cu").read_text()


def pct(a, qs=(0, 10, 50, 90, 100)):
    return " ".join(f"{np.percentile(a, q):7.2f}" for q in qs)


def main():
    K.bwd_tma_loop, K.bwd_tma_regs = 0, 96  # what the traced kernel is
    x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
    w = B.randn((3072,)) + 1
    _, rs = K.rms_norm_forward(x, w, 1e-6)
    _, mean, rstd = K.layer_norm_forward(x, None, None, 1e-6)
    configs = [(K.bwd_tma_early, K.bwd_tma_one_barrier)] + [c for c in ((1, True),) if c != (K.bwd_tma_early,
                                                                                                K.bwd_tma_one_barrier)]
    for (early, one_barrier), acc, label in [(c, a, lab) for c in configs
                                             for a, lab in ((2, "LayerNorm affine (dw, db)"), (1, "rms_norm (dw)"))]:
        K.bwd_tma_early, K.bwd_tma_one_barrier = early, one_barrier
        kernel, grid, block, stages, smem, cl = K._bwd_tma_plan(x.dtype, 4608, 3072, acc, True)
        regs = kernel.num_regs
        name = f"norm_bwd_tma_trace<__nv_bfloat16, 2, {acc}, 96>"
        mod = cp.RawModule(code=_SRC, options=L.NVRTC_OPTIONS, name_expressions=(name,))
        traced = mod.get_function(name)
        parts = cp.empty((acc, grid[0], 3072), dtype=np.float32)
        dx = cp.empty_like(x)
        trace = cp.zeros((grid[0], 12), dtype=np.int64)
        args = (dy, x, w, L.null() if acc == 1 else mean, rs if acc == 1 else rstd, dx, parts[0],
                parts[acc - 1] if acc == 2 else L.null(), L.i64(4608), L.i32(3072), L.i32(int(acc == 1)),
                L.i32(0), L.i32(stages), L.i32(K.bwd_tma_opts(stages)))
        t_lib = B.time_ms(lambda: L.launch(kernel, grid, block, args, shared_mem=smem))
        t_tr = B.time_ms(lambda: traced(grid, block, args + (trace,), shared_mem=smem))
        tr = cp.asnumpy(trace).astype(np.float64)
        g0 = tr[:, 0].min()
        start, first, end = (tr[:, 0] - g0) / 1e3, (tr[:, 1] - g0) / 1e3, (tr[:, 2] - g0) / 1e3  # us
        ghz = np.median(tr[:, 8] / (tr[:, 2] - tr[:, 0]))
        print(f"\n== {label}: grid {grid[0]} x {block[0]}, {stages} stages, {regs} registers (library kernel), "
              f"stages filled at entry {early or stages}, one-barrier reduction {one_barrier}, SM clock ~{ghz:.2f} GHz")
        print(f"kernel alone: library {t_lib:.4f} ms, traced {t_tr:.4f} ms; traced span (first entry -> last exit) "
              f"{end.max():.2f} us")
        print(f"{'us from the first entry':32s}    min     p10     p50     p90     max")
        print(f"{'block entry':32s} {pct(start)}")
        print(f"{'first row arrived':32s} {pct(first)}")
        print(f"{'first row, after entry':32s} {pct(first - start)}")
        for r in np.unique(tr[:, 10]):
            sel = tr[:, 10] == r
            print(f"{f'exit, blocks of {int(r)} rows ({sel.sum()})':32s} {pct(end[sel])}")
        tot = tr[:, 8]
        parts_ = {"issuing the first fills": tr[:, 11], "waiting for rows": tr[:, 3], "pass 1": tr[:, 4],
                  "block_sum2": tr[:, 5], "pass 2 (dx, partials)": tr[:, 6], "part rows": tr[:, 7]}
        print(f"{'share of a block cycles':32s}    min     p10     p50     p90     max")
        for k, v in parts_.items():
            print(f"{k:32s} {pct(100 * v / tot)}")
        other = tot - sum(v for k, v in parts_.items() if k != "issuing the first fills")
        print(f"{'other (loop, mean/rstd, init)':32s} {pct(100 * other / tot)}")
        rows = tr[:, 10]
        print(f"per row per block, us: wait {pct(tr[:, 3] / rows / ghz / 1e3)}")
        print(f"per row per block, us: busy {pct((tr[:, 4] + tr[:, 5] + tr[:, 6]) / rows / ghz / 1e3)}")
        sm = tr[:, 9].astype(int)
        per_sm_end = np.array([end[sm == i].max() for i in np.unique(sm)])
        per_sm_start = np.array([start[sm == i].min() for i in np.unique(sm)])
        print(f"{'SM busy span (first in -> last out)':32s} {pct(per_sm_end - per_sm_start)}")
        print(f"blocks per SM: {np.bincount(np.bincount(sm))}")


if __name__ == "__main__":
    main()
