"""Full fine-tuning of Flux-dev under a GPU memory budget -- kohya's flux_train.py with --blocks_to_swap and
--fused_backward_pass -- through FLAME's trainer, against the whole model resident.

FLAME: the trainer trains every weight of Flux-dev (random init, bf16 weights with train.full_bf16, Adafactor as kohya
and ai-toolkit set it for Flux: relative_step, scale_parameter and warmup_init off, lr 1e-5) on synthetic --size²
latents with 512 T5 tokens, batch 1, gradient checkpointing. Under max_gpu_memory = each of --budgets GiB the blocks
stream from pinned host memory and each is updated inside backward (flame_nn.offload.LayerwiseOptimizer); "none" is
the unconstrained run (every weight resident, one optimizer step after backward, the trainer's CUDA graph). The
peer (--peer, needs torch + diffusers + transformers): diffusers' FluxTransformer2DModel with transformers' Adafactor
(the same settings), bf16 weights, gradient checkpointing, resident (diffusers has no block swapping), one step =
forward under bf16, MSE against a random target, backward, optimizer step, zero_grad.

Each run is a subprocess of its own, so each peak is that run's. Per run: the step in ms (CUDA events, median of
--repeats after --warmup steps), the driver-observed device peak during the timed steps (cudaMemGetInfo sampled every
~1 ms: every allocation of the process, the pool's cache included), the pool's peak, the peak host RSS (pinned buffers
count), the resident / streamed blocks and the host->device bytes per step.

Run: PYTHONPATH=$PWD python3 bench/full_finetune.py [--budgets 24,none] [--size 1024] [--repeats 3] [--warmup 3]
     [--peer] [--small]   (--small: flux-tiny at 64², the cpu-checkable smoke run)
"""
import argparse
import json
import tempfile
import time

import common

ADAFACTOR = {"relative_step": False, "scale_parameter": False, "warmup_init": False}
LR = 1e-5


def _budgets(text):
    """'24,none' -> [24.0, None]: GiB > 0, or none (unconstrained)."""
    out = []
    for b in text.split(","):
        b = b.strip()
        if b == "none":
            out.append(None)
            continue
        try:
            v = float(b)
        except ValueError:
            v = 0
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{b!r}: GiB > 0 or none")
        out.append(v)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line naming the argument, exit status 2
        self.exit(2, f"{self.prog}: {message}\n")


def parse_args(argv=None):
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=_budgets, default="24,none",
                   help="GiB per run, comma-separated; 'none' = unconstrained")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3,
                   help="steps before timing (the resident run captures its graph at the third)")
    p.add_argument("--peer", action="store_true", help="also the diffusers + transformers' Adafactor resident peer")
    p.add_argument("--small", action="store_true", help="flux-tiny (smoke run; on the cpu without a GPU)")
    p.add_argument("--timeout", type=int, default=540, help="seconds per run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- one run (a child process)
def flame_run(res, spec):
    import flame_core as flame
    from flame_models.training.config import config_from_dict
    from flame_models.training.trainer import Trainer
    budget, cuda = spec["budget"], spec["device"] == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        d = {"name": "full", "training_folder": tmp, "device": spec["device"],
             "model": {"arch": "flux", "size": "flux-tiny" if spec["small"] else "flux-dev",
                       "dtype": "bf16" if cuda else "fp32"},
             "synthetic": {"num_samples": 4, "height": spec["size"], "width": spec["size"],
                           "text_length": 8 if spec["small"] else common.T5_LEN},
             "network": {"type": "full"},
             "train": {"steps": 10 ** 6, "batch_size": 1, "lr": LR, "optimizer": "adafactor",
                       "optimizer_params": dict(ADAFACTOR), "full_bf16": cuda, "dtype": "bf16" if cuda else "fp32",
                       "gradient_checkpointing": True, "disable_sampling": True},
             "sample": {"sample_every": 0}, "save": {"save_every": 10 ** 6}}
        if budget is not None:
            d["max_gpu_memory"] = f"{budget}GiB"
        cfg = config_from_dict(d, check_files=False)
        t0 = time.perf_counter()
        tr = Trainer(cfg, verbose=True).setup()
        res.log("build_s", round(time.perf_counter() - t0, 1))
        res.log("trained_parameters", sum(p.numel() for p in tr.params))
        st = tr.streamer
        if st is not None:
            res.log("resident_blocks", len(st.resident))
            res.log("streamed_blocks", len(st.streamed))
            res.log("host_pinned_GiB", common.gib(st.host_pinned_bytes, 2))
        for _ in range(spec["warmup"]):
            tr.train_step()
        if st is not None:
            st.reset_stats()
        res.log("graphed", bool(tr.graphed is not None and tr.graphed.captured))
        flame.memory.reset_peak_memory_stats(spec["device"])
        if cuda:
            import streaming
            common.synchronize()
            with streaming.DevicePeak() as dp:
                ms, _, all_ms = common.cuda_ms(tr.train_step, spec["repeats"], warmup=0)
            res.log("driver_peak_GiB", common.gib(dp.peak, 2))
        else:
            ms, all_ms = common.host_ms(tr.train_step, spec["repeats"])
        res.log("step_ms", round(ms, 1))
        res.log("step_ms_all", [round(x, 1) for x in all_ms])
        res.log("pool_peak_GiB", common.gib(flame.memory.max_memory_reserved(spec["device"]), 2))
        if st is not None:
            res.log("h2d_GB_per_step", round(st.stats["bytes_h2d"] / spec["repeats"] / 1e9, 2))
            res.log("block_updates_per_step", tr.optimizer.block_steps / (spec["warmup"] + spec["repeats"]))
        loss = tr.train_step()[0]
        res.log("loss_finite", bool(loss == loss))


def peer_run(res, spec):
    """diffusers' Flux-dev with transformers' Adafactor, bf16, checkpointing, resident: one full training step."""
    import torch
    from transformers.optimization import Adafactor
    model = common.diffusers_flux().requires_grad_(True)
    model.enable_gradient_checkpointing()
    model.train()
    opt = Adafactor(model.parameters(), lr=LR, **ADAFACTOR)
    kw = common.diffusers_inputs(spec["size"], 3.5)
    target = torch.randn_like(kw["hidden_states"], dtype=torch.float32)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(**kw)[0]
        loss = ((pred.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    for _ in range(spec["warmup"]):
        step()
    import streaming
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with streaming.DevicePeak() as dp:
        ms, _, all_ms = common.cuda_ms(step, spec["repeats"], warmup=0, lib="torch")
    res.log("driver_peak_GiB", common.gib(dp.peak, 2))
    res.log("torch_peak_allocated_GiB", common.gib(torch.cuda.max_memory_allocated(), 2))
    res.log("step_ms", round(ms, 1))
    res.log("step_ms_all", [round(x, 1) for x in all_ms])
    res.log("loss_finite", bool(torch.isfinite(step()).item()))


def child(spec, out_path):
    res = common.Results(f"full_finetune_{spec['tag']}")
    t0, err = time.perf_counter(), None
    try:
        (peer_run if spec["tag"] == "peer" else flame_run)(res, spec)
    except Exception as e:  # the row says why; the other runs go on
        import traceback
        traceback.print_exc()
        err = common.error_line(e)
    common.end_child(out_path, spec, res, err, t0)


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        return child(json.loads(a.child), a.child_out)
    import flame_core as flame
    device = "cuda" if flame.cuda_is_available() else "cpu"
    size = 64 if a.small else a.size
    specs = []
    for budget in a.budgets:
        specs.append(dict(tag="flame_resident" if budget is None else f"flame_{budget:g}GiB", budget=budget,
                          device=device, size=size, small=a.small, repeats=a.repeats, warmup=a.warmup))
    if a.peer:
        specs.append(dict(tag="peer", budget=None, device=device, size=size, small=a.small, repeats=a.repeats,
                          warmup=a.warmup))
    res = common.Results("full_finetune")
    rows = []
    for spec in specs:
        got = common.run_child(__file__, spec, a.timeout, spec["tag"])
        r = got["results"]
        res.log(spec["tag"], {**r, "error": got["error"], "host_peak_rss_GiB": got.get("host_peak_rss_GiB"),
                              "wall_s": got.get("wall_s")})
        rows.append([spec["tag"], r.get("step_ms"), r.get("driver_peak_GiB"), got.get("host_peak_rss_GiB"),
                     f"{r.get('resident_blocks', '-')}/{r.get('streamed_blocks', '-')}", got["error"] or ""])
    peer = res.get("peer", {}).get("step_ms")
    for row in rows:
        row.insert(2, common.ratio(row[1], peer) if peer and row[1] else None)
    print(common.table(["run", "step ms", "÷ peer", "driver peak GiB", "host RSS GiB", "resident/streamed",
                        "error"], rows, title=f"Flux-dev full fine-tune at {size}², {device}"))
    print("saved", res.save())


if __name__ == "__main__":
    main()
