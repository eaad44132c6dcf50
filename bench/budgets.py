"""Budget matrix: a family's LoRA training step at 1024² under a list of GPU memory budgets (auto_fit plans each:
resident / streamed blocks, activation offload, fp8 outside the blocks) and unconstrained (every block resident), in
bf16 and fp8 storage of the frozen weights, and fp8c (fp8 storage whose matmuls run on the e4m3 tensor cores:
train.fp8_compute) -- each run in a subprocess of its own, so every peak is that run's.

Per run: step ms (CUDA events, median of --repeats after --warmup; with --graph also forward + backward replayed as
a CUDA graph), the driver-observed device peak (cudaMemGetInfo sampled every ~1 ms during the timed steps, as
bench/streaming.py), the pool's peak, the peak host RSS of the run's process (getrusage; pinned buffers count), the
resident / streamed blocks, activation offload, the host->device bytes per step and the share of copy time hidden:
1 - max(0, step - unconstrained step) / copy time (against the unconstrained run of the same family and storage,
whichever call measured it).
Families: flux (Flux-dev; bench/streaming.py's step: LoRA r16 on attention, AdamW, bf16 autocast, T5 512,
checkpointing; eager, and with --graph also the graphed step); sd3.5-large, sdxl, qwen-image, chroma and
flux-kontext through FLAME's trainer (random weights of the preset drawn block by block, synthetic 1024² latents with
333 / 77 / 512 / 129 / 512 text tokens -- Chroma's 129: the attended length its LoRA bench cuts T5 to -- and for
Kontext a 1024² control image's reference tokens beside the target's, LoRA r16 on
attention, --optimizer (the trainer's default adamw8bit), bf16, checkpointing, max_gpu_memory = the budget,
model.quantize for fp8 (and train.fp8_compute for fp8c); the trainer's own step: graphed with --graph, else eager;
the copy time of a trainer run is estimated from its bytes at H2D_GBPS). --offload auto,off runs each budget both
ways (auto: as auto_fit plans; on / off: forced).

The matrix fills over several GPU calls: each call's runs are MERGED into --matrix (default
docs/budget_matrix.json; a run replaces the row of its key), and the merged rows are written with their markdown page
and SVG plot (bench/budget_matrix.py) to --matrix-out (default $OUT, else docs/); copy the three files back into
docs/ to keep them. --render-only re-renders a matrix file with no run (no GPU needed).

Run: PYTHONPATH=$PWD python3 bench/budgets.py [--families flux,sd3.5-large,sdxl] [--budgets 4,6,8,12,16,24,none]
        [--storages bf16,fp8,fp8c] [--offload auto[,on,off]] [--graph] [--repeats 5] [--warmup 2] [--matrix PATH]
        [--matrix-out DIR] [--render-only]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import budget_matrix
import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trainer families: arch, the size preset (and --small's), text tokens of a sample (Qwen-Image: the LoRA
# bench's 512; Chroma: the 129 attended tokens its bench cuts T5 to)
TRAINER_FAMILIES = {"sd3.5-large": dict(arch="sd3", size="sd3.5-large", small="sd3.5-tiny", text=77 + 256),
                    "sdxl": dict(arch="sdxl", size="sdxl-base", small="sdxl-tiny", text=77),
                    "qwen-image": dict(arch="qwen_image", size="qwen-image", small="qwen-image-tiny", text=512),
                    "chroma": dict(arch="chroma", size="chroma", small="chroma-tiny", text=129),
                    "flux-kontext": dict(arch="flux_kontext", size="flux-dev", small="flux-tiny", text=512)}
FAMILIES = ("flux",) + tuple(TRAINER_FAMILIES)
H2D_GBPS = 54.6  # pinned host->device copies in a Flux-dev streamed step on the H200 (budgets.py, 4 GiB fp8)
STORAGES = ("bf16", "fp8", "fp8c")
OFFLOAD = {"auto": None, "on": True, "off": False}
DEFAULT_BUDGETS = "4,6,8,12,16,24,none"


class UsageError(ValueError):
    pass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="flux", help=f"comma-separated, of: {', '.join(FAMILIES)}")
    ap.add_argument("--optimizer", default="adamw8bit", help="the trainer families' optimizer (flux: AdamW)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the trainer families' smoke test
    ap.add_argument("--matrix", default=os.path.join(ROOT, "docs", "budget_matrix.json"),
                    help="the matrix JSON the runs are merged into (read; a missing file is an empty matrix)")
    ap.add_argument("--matrix-out", default=None, help="folder for the merged budget_matrix.json/.md/.svg "
                                                       "(default: $OUT, else the --matrix file's folder)")
    ap.add_argument("--render-only", action="store_true", help="render --matrix into --matrix-out, run nothing")
    ap.add_argument("--budgets", default=DEFAULT_BUDGETS, help="GiB, comma-separated; 'none': unconstrained")
    ap.add_argument("--storages", default="bf16,fp8",
                    help="comma-separated, of: bf16, fp8 (storage), fp8c (fp8 storage and fp8 compute)")
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
    if a.device not in ("cuda", "cpu"):
        raise UsageError(f"--device: expected cuda or cpu, got {a.device!r}")
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
def trainer_run(res, spec):
    """One sd3.5-large / sdxl run through FLAME's trainer (see the module docstring); logs under the run's tag."""
    import flame_core as flame
    import flame_core.memory as M
    from flame_models.training.config import config_from_dict
    from flame_models.training.trainer import Trainer
    fam, tag, budget = TRAINER_FAMILIES[spec["family"]], tag_of(spec), spec["budget"]
    cuda = spec.get("device", "cuda") == "cuda"
    dtype = "bf16" if cuda else "fp32"  # (the cpu smoke run: fp32 numbers)
    train = {"steps": 10 ** 6, "batch_size": 1, "lr": 1e-4, "optimizer": spec.get("optimizer", "adamw8bit"),
             "dtype": dtype, "gradient_checkpointing": True, "disable_sampling": True,
             "cuda_graph": bool(spec["graph"]), "fp8_compute": spec["storage"] == "fp8c"}
    if budget is not None:
        train["offload_activations"] = OFFLOAD[spec["offload"]]
    with tempfile.TemporaryDirectory() as tmp:
        d = {"name": "budget", "training_folder": tmp, "device": spec.get("device", "cuda"),
             "model": {"arch": fam["arch"], "size": fam["small"] if spec["small"] else fam["size"],
                       "quantize": spec["storage"] in ("fp8", "fp8c"), "dtype": dtype},
             "synthetic": {"num_samples": 4, "height": spec["size"], "width": spec["size"], "text_length": fam["text"]},
             "network": {"type": "lora", "linear": 4 if spec["small"] else 16, "linear_alpha": 4 if spec["small"]
                         else 16, "target": "attention"},
             "train": train, "sample": {"sample_every": 0}, "save": {"save_every": 10 ** 6}}
        if budget is not None:
            d["max_gpu_memory"] = f"{budget}GiB"
        cfg = config_from_dict(d, check_files=False)
        t0 = time.perf_counter()
        tr = Trainer(cfg, verbose=False).setup()
        res.log("build_s", round(time.perf_counter() - t0, 1))
        st, fit = tr.streamer, tr.fit if budget is not None else None
        if fit is not None:
            print(fit, flush=True)
            res.log(f"{tag}_resident_blocks", len(fit.resident))
            res.log(f"{tag}_streamed_blocks", len(fit.streamed))
            res.log(f"{tag}_minimum_GiB", common.gib(fit.minimum, 3))
            res.log(f"{tag}_offload_activations", fit.offload_activations)
            res.log(f"{tag}_offloaded_GiB_per_step", common.gib(fit.offloaded_bytes, 3))
            res.log(f"{tag}_outside_fp8", len(fit.outside_fp8))
            res.log(f"{tag}_fit_plan", str(fit.plan))
            res.log(f"{tag}_activation_host_GiB", common.gib(fit.activation_host_bytes, 3))
            res.log(f"{tag}_host_pinned_GiB", common.gib(fit.host_pinned_bytes, 3))   # the least host RAM
        else:
            n = sum(len(tr.model.get_submodule(s)) for s in tr.family.block_stacks(tr.model))
            res.log(f"{tag}_resident_blocks", n)
            res.log(f"{tag}_streamed_blocks", 0)
        if st is not None:  # every block has its host copy (pinned), resident ones too
            res.log(f"{spec['storage']}_block_GiB_total", common.gib(sum(st.block_bytes(i) for i in range(len(st))),
                                                                      3))
        # warm up until the step's graph is captured (the first steps are eager; a capture over the budget demotes
        # blocks and captures again at the next step), or it gave up, or a few tries
        want, steps, g = max(spec["warmup"], 3 if spec["graph"] else 1), 0, tr.graphed
        while steps < want or (g is not None and g.enabled and not g.captured and steps < want + 4):
            tr.train_step()
            steps += 1
        res.log(f"{tag}_warmup_steps", steps)
        if g is not None and g.failure:  # the capture failed for good, or a retry (after demoting blocks) captured it
            res.log(f"{tag}_graph_error" if not g.captured else f"{tag}_graph_first_capture", g.failure)
        if st is not None:
            res.log(f"{tag}_graph_demotions", tr.streaming.demotions)
            st.reset_stats()
        graphed = bool(g is not None and g.captured)
        key = f"{tag}_graph" if graphed else tag
        if cuda:
            import streaming
            common.synchronize()
            M.reset_peak_memory_stats()
            with streaming.DevicePeak() as dp, common.GpuClocks() as clk:
                ms, _, all_ms = common.cuda_ms(tr.train_step, spec["repeats"], warmup=0)
            res.log(f"{key}_driver_peak_GiB", common.gib(dp.peak, 3))
            res.log(f"{key}_clocks", clk.summary)
        else:
            ms, all_ms = common.host_ms(tr.train_step, spec["repeats"])
        res.log(f"{key}_step_ms", round(ms, 1))
        res.log(f"{key}_step_ms_all", [round(x, 1) for x in all_ms])
        res.log(f"{key}_pool_peak_reserved_GiB", common.gib(flame.memory.max_memory_reserved(spec.get("device",
                                                                                                      "cuda")), 3))
        if graphed:
            res.log(f"{tag}_graph_resident_blocks", len(st.resident) if st is not None else None)
        if st is not None and st.streamed:
            g = st.graph_stats if graphed else None
            nbytes = g["bytes_h2d"] if g is not None else st.stats["bytes_h2d"] / spec["repeats"]
            res.log(f"{tag}_h2d_GB_per_step", round(nbytes / 1e9, 2))
            res.log(f"{tag}_h2d_s_per_step", round(nbytes / (H2D_GBPS * 1e9), 4))
            res.log(f"{tag}_h2d_s_estimated", True)
        del tr


def child(spec, out_path):
    a = argparse.Namespace(**spec)
    res = common.Results(f"budgets_{spec['family']}_{tag_of(spec)}")
    res.path = out_path + ".results.json"  # (the child's own file; the parent collects what it returns)
    t0 = time.perf_counter()
    err = None
    try:
        if spec["family"] in TRAINER_FAMILIES:
            trainer_run(res, spec)
        else:
            import streaming
            run = streaming.Run(res, spec["storage"], a.size, a.small, a.graph, offload=OFFLOAD[spec["offload"]])
            res.log("build_s", round(time.perf_counter() - t0, 1))
            run.config(spec["budget"], a.repeats, a.warmup)
    except Exception as e:  # the row says why; the other runs go on
        import traceback
        traceback.print_exc()
        err = common.error_line(e)
    common.end_child(out_path, spec, res, err, t0)


def run_child(spec, timeout):
    """Run one spec in a fresh process; returns its result dict (with 'error' set when it failed)."""
    return common.run_child(__file__, spec, timeout, f"{spec['family']} {tag_of(spec)} offload={spec['offload']}")


# ----------------------------------------------------------------------------- the rows and the table
def rows_of(runs, context=None):
    """The matrix rows (bench/budget_matrix.py) of the children's results; `context` (commit, date) goes on each."""
    ctx = context or {}
    rows = []
    for r in runs:
        s, res, t = r["spec"], r["results"], tag_of(r["spec"])
        resident, streamed = res.get(f"{t}_resident_blocks"), res.get(f"{t}_streamed_blocks", 0)
        if res.get(f"{t}_graph_resident_blocks") is not None and resident is not None:  # a capture demoted blocks
            resident, streamed = res[f"{t}_graph_resident_blocks"], resident + streamed - res[
                f"{t}_graph_resident_blocks"]
        rows.append(dict(
            family=s["family"], storage=s["storage"], budget=s["budget"], offload_mode=s["offload"],
            step_ms=res.get(f"{t}_step_ms"), graph_step_ms=res.get(f"{t}_graph_step_ms"),
            driver_peak_GiB=res.get(f"{t}_driver_peak_GiB"),
            graph_driver_peak_GiB=res.get(f"{t}_graph_driver_peak_GiB"),
            pool_peak_GiB=res.get(f"{t}_graph_pool_peak_reserved_GiB", res.get(f"{t}_pool_peak_reserved_GiB")),
            host_peak_rss_GiB=r.get("host_peak_rss_GiB"), resident=resident, streamed=streamed,
            offload_activations=res.get(f"{t}_offload_activations", False),
            offloaded_GiB=res.get(f"{t}_offloaded_GiB_per_step"), outside_fp8=res.get(f"{t}_outside_fp8"),
            h2d_GB=next((v for v in (res.get(f"{t}_graph_h2d_GB_per_step"), res.get(f"{t}_h2d_GB_per_step"))
                         if v is not None), None),
            h2d_s=res.get(f"{t}_h2d_s_per_step"), h2d_s_estimated=bool(res.get(f"{t}_h2d_s_estimated")),
            minimum_GiB=res.get(f"{t}_minimum_GiB"), wall_s=r.get("wall_s"),
            host_blocks_GiB=res.get(f"{s['storage']}_block_GiB_total"),
            activation_host_GiB=res.get(f"{t}_activation_host_GiB"),
            clocks=res.get(f"{t}_graph_clocks", res.get(f"{t}_clocks")),
            note=(f"first capture failed ({res[f'{t}_graph_first_capture'][:60]}), captured after demoting blocks"
                  if res.get(f"{t}_graph_first_capture") else None),
            error=r.get("error") or res.get(f"{t}_fit") or res.get(f"{t}_error") or res.get(f"{t}_graph_error"),
            commit=ctx.get("commit"), date=ctx.get("date")))
    return rows


def report(rows):
    rows = budget_matrix.with_hidden(rows)
    pct = (lambda h: "-" if h is None else f"{100 * h:.0f}%")
    table = [[r["family"], r["storage"], "none" if r["budget"] is None else f"{r['budget']} GiB", r["offload_mode"],
              f"{r['resident']}/{r['streamed']}", "yes" if r["offload_activations"] else "no", r["step_ms"],
              r["graph_step_ms"], f"{r['driver_peak_GiB']} / {r['graph_driver_peak_GiB']}", r["pool_peak_GiB"],
              r["host_peak_rss_GiB"], r["h2d_GB"], f"{pct(r.get('hidden'))} / {pct(r.get('graph_hidden'))}",
              "; ".join(n for n in ((str(r["error"])[:70] if r["error"] else ""),
                                    budget_matrix.clock_note(r.get("clocks"))) if n)] for r in rows]
    return common.table(["family", "storage", "budget", "mode", "res/str", "offload", "eager ms", "graph ms",
                         "driver GiB e/g", "pool GiB", "host RSS GiB", "H2D GB", "hidden e/g", "note"], table,
                        title="\nLoRA step at 1024² under GPU memory budgets (driver-observed peaks; each run its own "
                              "process)")


def matrix_out(a):
    return a.matrix_out or os.environ.get("OUT") or os.path.dirname(os.path.abspath(a.matrix))


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        child(spec, a.child_out)
        return 0
    try:
        runs = plan_runs(a)
        old = budget_matrix.load(a.matrix)  # (a damaged matrix is reported before any run)
    except (UsageError, budget_matrix.MatrixError) as e:
        print(f"budgets.py: {e}", file=sys.stderr)
        return 2
    if a.render_only:
        for p in budget_matrix.write_all(old, matrix_out(a)):
            print(p)
        return 0
    common_spec = dict(size=a.size, repeats=a.repeats, warmup=a.warmup, graph=a.graph, small=a.small,
                       optimizer=a.optimizer, device=a.device)
    if a.dry_run:
        for r in runs:
            print(json.dumps({**r, **common_spec}))
        return 0
    res = common.Results("budgets_runs")
    ctx = common.context()
    ctx = {"commit": ctx.get("commit"), "date": ctx.get("date")}
    done = []
    for r in runs:
        done.append(run_child({**r, **common_spec}, a.timeout))
        res["runs"] = rows_of(done, ctx)
        res.save()
        merged = budget_matrix.merge(old, res["runs"])  # after every run: a call cut short keeps what it measured
        paths = budget_matrix.write_all(merged, matrix_out(a))
    print(report(res["runs"]), flush=True)
    print("matrix: " + ", ".join(paths), flush=True)
    return 1 if all(d.get("error") for d in done) else 0


if __name__ == "__main__":
    sys.exit(main())
