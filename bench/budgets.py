"""Budget matrix: a family's LoRA training step at 1024² under a list of GPU memory budgets (auto_fit plans each:
resident / streamed blocks, activation offload, fp8 outside the blocks) and unconstrained (every block resident), in
bf16 and fp8 storage of the frozen weights -- each run in a subprocess of its own, so every peak is that run's.

Per run: step ms (CUDA events, median of --repeats after --warmup; with --graph also forward + backward replayed as
a CUDA graph), the driver-observed device peak (cudaMemGetInfo sampled every ~1 ms during the timed steps, as
bench/streaming.py), the pool's peak, the peak host RSS of the run's process (getrusage; pinned buffers count), the
resident / streamed blocks, activation offload, the host->device bytes per step and the share of copy time hidden:
1 - max(0, step - unconstrained step) / copy time (needs the unconstrained run of the same family and storage).
Families: flux (Flux-dev; bench/streaming.py's step: LoRA r16 on attention, AdamW, bf16 autocast, T5 512,
checkpointing). --offload auto,off runs each budget both ways (auto: as auto_fit plans; on / off: forced).
Writes one table (printed last) and $OUT/budgets.json.

Run: PYTHONPATH=$PWD python3 bench/budgets.py [--families flux] [--budgets 4,6,8,12,16,24,none] [--storages bf16,fp8]
                                              [--offload auto[,on,off]] [--graph] [--repeats 5] [--warmup 2]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

FAMILIES = ("flux",)
STORAGES = ("bf16", "fp8")
OFFLOAD = {"auto": None, "on": True, "off": False}
DEFAULT_BUDGETS = "4,6,8,12,16,24,none"


class UsageError(ValueError):
    pass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="flux", help=f"comma-separated, of: {', '.join(FAMILIES)}")
    ap.add_argument("--budgets", default=DEFAULT_BUDGETS, help="GiB, comma-separated; 'none': unconstrained")
    ap.add_argument("--storages", default="bf16,fp8", help="bf16, fp8 or both")
    ap.add_argument("--offload", default="auto", help="activation offload, comma-separated modes of auto (as the "
                                                      "budget needs), on, off; each budget runs once per mode")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--graph", action="store_true", help="also replay forward+backward as a CUDA graph")
    ap.add_argument("--small", action="store_true", help="2 double + 4 single blocks (a smoke run)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one run: its spec (JSON); results to --child-out
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def plan_runs(a):
    """[{family, storage, budget (GiB or None), offload}] in the order they run (unconstrained first: the hidden
    share of the budgets needs its step time). UsageError names a bad value."""
    fams = [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [f for f in fams if f not in FAMILIES]
    if bad or not fams:
        raise UsageError(f"--families: unknown {bad or fams}; available: {', '.join(FAMILIES)}")
    storages = [s.strip() for s in a.storages.split(",") if s.strip()]
    bad = [s for s in storages if s not in STORAGES]
    if bad or not storages:
        raise UsageError(f"--storages: unknown {bad or storages}; available: {', '.join(STORAGES)}")
    budgets = []
    for b in a.budgets.split(","):
        b = b.strip().lower()
        if not b:
            continue
        if b in ("none", "unconstrained"):
            budgets.append(None)
            continue
        try:
            v = float(b)
        except ValueError:
            raise UsageError(f"--budgets: {b!r} is not a number of GiB (or 'none')") from None
        if v <= 0:
            raise UsageError(f"--budgets: {b!r} must be positive")
        budgets.append(int(v) if v == int(v) else v)
    if not budgets:
        raise UsageError("--budgets: no budget given")
    budgets = sorted(set(budgets), key=lambda b: (b is not None, b or 0))
    modes = [m.strip() for m in a.offload.split(",") if m.strip()]
    bad = [m for m in modes if m not in OFFLOAD]
    if bad or not modes:
        raise UsageError(f"--offload: unknown {bad or modes}; available: {', '.join(OFFLOAD)}")
    return [dict(family=f, storage=s, budget=b, offload=m) for f in fams for s in storages for b in budgets
            for m in (modes if b is not None else modes[:1])]


def tag_of(run):
    return f"{run['storage']}_resident" if run["budget"] is None else f"{run['storage']}_{run['budget']}GiB"


# ----------------------------------------------------------------------------- one run (the child process)
def child(spec, out_path):
    import resource

    import streaming
    a = argparse.Namespace(**spec)
    res = common.Results(f"budgets_{spec['family']}_{tag_of(spec)}")
    res.path = out_path + ".results.json"  # (the child's own file; the parent collects what it returns)
    t0 = time.perf_counter()
    err = None
    try:
        if spec["family"] != "flux":
            raise UsageError(f"family {spec['family']!r} has no budget run")
        run = streaming.Run(res, spec["storage"], a.size, a.small, a.graph, offload=OFFLOAD[spec["offload"]])
        res.log("build_s", round(time.perf_counter() - t0, 1))
        run.config(spec["budget"], a.repeats, a.warmup)
    except Exception as e:  # the row says why; the other runs go on
        import traceback
        traceback.print_exc()
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    out = {"spec": spec, "results": dict(res), "error": err,
           "host_peak_rss_GiB": common.gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 2),
           "wall_s": round(time.perf_counter() - t0, 1)}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the results are on disk: no interpreter teardown (it printed errors from CuPy's exit hooks)


def run_child(spec, timeout):
    """Run one spec in a fresh process; returns its result dict (with 'error' set when it failed)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--child-out", out]
        common.section(f"{spec['family']} {tag_of(spec)} offload={spec['offload']}")
        try:
            p = subprocess.run(cmd, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return {"spec": spec, "results": {}, "error": f"run ended without results (exit {rc})"}


# ----------------------------------------------------------------------------- the table
def hidden(ms, base_ms, copy_s):
    if not isinstance(ms, (int, float)) or not isinstance(base_ms, (int, float)) or not copy_s:
        return None
    return round(max(0.0, 1 - max(0.0, ms - base_ms) / 1e3 / copy_s), 3)


def rows_of(runs):
    """Table rows and per-run summaries from the children's results."""
    base = {}
    for r in runs:
        s = r["spec"]
        if s["budget"] is None:
            t = tag_of(s)
            base[(s["family"], s["storage"])] = (r["results"].get(f"{t}_step_ms"),
                                                 r["results"].get(f"{t}_graph_step_ms"))
    rows, summary = [], []
    for r in runs:
        s, res, t = r["spec"], r["results"], tag_of(r["spec"])
        b0 = base.get((s["family"], s["storage"]), (None, None))
        ms, gms = res.get(f"{t}_step_ms"), res.get(f"{t}_graph_step_ms")
        copy_s = res.get(f"{t}_h2d_s_per_step")
        row = dict(family=s["family"], storage=s["storage"], budget=s["budget"], offload_mode=s["offload"],
                   step_ms=ms, graph_step_ms=gms, driver_peak_GiB=res.get(f"{t}_driver_peak_GiB"),
                   graph_driver_peak_GiB=res.get(f"{t}_graph_driver_peak_GiB"),
                   pool_peak_GiB=res.get(f"{t}_pool_peak_reserved_GiB"), host_peak_rss_GiB=r.get("host_peak_rss_GiB"),
                   resident=res.get(f"{t}_resident_blocks"), streamed=res.get(f"{t}_streamed_blocks", 0),
                   offload_activations=res.get(f"{t}_offload_activations", False),
                   offloaded_GiB=res.get(f"{t}_offloaded_GiB_per_step"), h2d_GB=res.get(f"{t}_h2d_GB_per_step"),
                   hidden=hidden(ms, b0[0], copy_s) if s["budget"] is not None else None,
                   graph_hidden=hidden(gms, b0[1], copy_s) if s["budget"] is not None else None,
                   error=r.get("error") or res.get(f"{t}_fit") or res.get(f"{t}_error")
                   or res.get(f"{t}_graph_error"))
        summary.append(row)
        pct = (lambda h: "-" if h is None else f"{100 * h:.0f}%")
        rows.append([row["family"], row["storage"], "none" if s["budget"] is None else f"{s['budget']} GiB",
                     f"{row['resident']}/{row['streamed']}", "yes" if row["offload_activations"] else "no",
                     ms, gms, f"{row['driver_peak_GiB']} / {row['graph_driver_peak_GiB']}", row["pool_peak_GiB"],
                     row["host_peak_rss_GiB"], row["h2d_GB"], f"{pct(row['hidden'])} / {pct(row['graph_hidden'])}",
                     (str(row["error"])[:70] if row["error"] else "")])
    return rows, summary


def report(runs):
    rows, _ = rows_of(runs)
    return common.table(["family", "storage", "budget", "res/str", "offload", "eager ms", "graph ms",
                         "driver GiB e/g", "pool GiB", "host RSS GiB", "H2D GB", "hidden e/g", "note"], rows,
                        title="\nLoRA step at 1024² under GPU memory budgets (driver-observed peaks; each run its own "
                              "process)")


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        child(spec, a.child_out)
        return 0
    try:
        runs = plan_runs(a)
    except UsageError as e:
        print(f"budgets.py: {e}", file=sys.stderr)
        return 2
    common_spec = dict(size=a.size, repeats=a.repeats, warmup=a.warmup, graph=a.graph, small=a.small)
    if a.dry_run:
        for r in runs:
            print(json.dumps({**r, **common_spec}))
        return 0
    res = common.Results("budgets")
    done = []
    for r in runs:
        done.append(run_child({**r, **common_spec}, a.timeout))
        res["runs"] = rows_of(done)[1]
        res.save()
    print(report(done), flush=True)
    return 1 if all(d.get("error") for d in done) else 0


if __name__ == "__main__":
    sys.exit(main())
