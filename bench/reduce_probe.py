"""Probe: how fast can B blocks add B rows of n fp32 values into one row? (the weight-gradient sums of the norm
backward: LayerNorm 4608x3072 writes 396 part rows of 2 x 3072.) Paths (bench/probes/reduce_paths.cu):
  bulk  every block stages its row in shared memory and adds it into the accumulator by bulk reduce-adds
        (cp.reduce.async.bulk .add.f32, `chunks` of them, one thread each);
  red   every thread adds its 16-byte pieces by red.global.add.v4.f32;
  part  every block stores its row as part row b, then the library's column_sum launch sums them (the current path).
Same protocol as bench/kernels.py (L2 evicted and a GPU-side wait before each call, CUDA events, median of 30); each
path is checked against the NumPy sum. Run: PYTHONPATH=$PWD python3 bench/reduce_probe.py"""
import pathlib
import sys

sys.path.insert(0, "bench")
sys.argv = sys.argv[:1]
import kernels as B  # noqa: E402
import numpy as np  # noqa: E402
from flame_core.kernels import loader as L  # noqa: E402

cp = B.cp
_mod = cp.RawModule(code=(pathlib.Path(__file__).parent / "probes" / "reduce_paths.cu").read_text(),
                    options=("-std=c++17", "-arch=sm_90"))
bulk, red, part_store = (_mod.get_function(k) for k in ("bulk_reduce", "red_v4", "part_store"))


def expected(nb, n):
    b, c = np.arange(nb)[:, None], np.arange(n)[None, :]
    return (((b * 7 + c * 13) % 31) - 15).astype(np.float64).sum(0)


def main():
    print(f"{'blocks':>6} {'n':>6} {'path':>12} {'ms':>8}  max abs err")
    for nb, n in ((396, 6144), (396, 3072), (198, 6144), (132, 6144)):
        want = expected(nb, n)
        acc = cp.zeros(n, dtype=np.float32)
        rows = []
        for chunks in (1, 4, 16):
            if (n // chunks) % 4:
                continue

            def run(chunks=chunks):
                bulk((nb,), (192,), (acc, np.int32(n), np.int32(chunks)), shared_mem=n * 4)
            acc.fill(0)
            run()
            err = float(np.abs(cp.asnumpy(acc) - want).max())
            rows.append((f"bulk x{chunks}", B.time_ms(run), err))

        def run_red():
            red((nb,), (192,), (acc, np.int32(n)))
        acc.fill(0)
        run_red()
        rows.append(("red.v4", B.time_ms(run_red), float(np.abs(cp.asnumpy(acc) - want).max())))
        part = cp.empty((nb, n), dtype=np.float32)

        def run_part():
            part_store((nb,), (192,), (part, np.int32(n)))
            return L.column_sum("norms", "column_sum", part, np.float32, dependent=True)
        out = run_part()
        rows.append(("part+csum", B.time_ms(run_part), float(np.abs(cp.asnumpy(out).ravel() - want).max())))

        def run_store():
            part_store((nb,), (192,), (part, np.int32(n)))
        rows.append(("part alone", B.time_ms(run_store), float("nan")))
        for label, ms, err in rows:
            print(f"{nb:>6} {n:>6} {label:>12} {ms:8.4f}  {err:.3g}")


if __name__ == "__main__":
    main()
