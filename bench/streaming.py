"""Block streaming on the GPU: bench/flux_lora.py's Flux-dev LoRA step (11.9B params, LoRA r16 a16 on q/k/v/out
in fp32, AdamW, bf16 autocast, batch 1, T5 512, 1024x1024, guidance 1.0, gradient checkpointing) with the blocks
streamed from pinned host memory under memory budgets, bf16 and fp8 storage of the frozen weights.

For each storage the model is built block by block (random N(0, 0.02) weights drawn on the GPU one block at a time
and packed into pinned memory: the whole model is never on the GPU), then:
  resident     every block on the GPU (the reference step; fp8's forward error against bf16 at the same weights)
  budget B     flame_nn.offload.auto_fit picks the resident blocks for B; B is then the pool's limit. Timed: the full
               step (forward, backward, AdamW).
Per configuration: step time (CUDA events, median of --repeats after --warmup), pool peak (max reserved), driver peak
(device memory in use, all processes, sampled every ~1 ms during the timed steps), H2D bytes per step and GB/s
(events around every copy) against the 54.9 GB/s pinned ceiling, and the share of transfer time hidden behind
compute: 1 - max(0, step - resident step) / transfer time. --graph adds the same with forward + backward replayed as
one CUDA graph (copies included; AdamW eager), as the trainer runs on cuda. The peer (diffusers + PEFT with
checkpointing, bench/flux_lora.py's) runs last when diffusers and peft import. Acceptance: 12 GiB bf16 and 10 GiB fp8
with peak <= budget and step <= 1.5x the peer. --layerwise D,S,B: full fine-tuning of a Flux-dev-width model of D
double + S single blocks under a B GiB limit (LayerwiseAdamW, state in pinned memory).
--fp8c-budgets B,...: the same with fp8 compute too (storage 'fp8c': one scale per weight tensor, the blocks' matmuls
on the e4m3 tensor cores, flame_nn.offload.fp8_compute); off unless given.
Run: PYTHONPATH=$PWD python3 bench/streaming.py [--budgets 24,16,12] [--fp8-budgets 24,16,12,10] [--graph]
     [--fp8c-budgets 24,6]
"""
import argparse
import gc
import sys
import threading
import time
import traceback

import common
import numpy as np

CEILING_GBS = 54.9  # pinned host->device copies measured on the H100 (cupy, 1 GiB)
GiB = 2 ** 30


class DevicePeak:
    """Peak device memory in use (cudaMemGetInfo: total - free, every process) sampled by a thread."""

    def __init__(self, interval=0.001):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _run(self):
        import cupy as cp
        cp.cuda.Device(0).use()
        while not self._stop.is_set():
            free, total = cp.cuda.runtime.memGetInfo()
            self.peak = max(self.peak, total - free)
            time.sleep(self.interval)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _first_line(e):
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


# ----------------------------------------------------------------------------- FLAME
def streamed_flux(params, before_stream=None, **streamer_kw):
    """A Flux of `params` with random N(0, 0.02) bf16 weights (norm scales 1), its blocks in a BlockStreamer (all
    streamed): the parts outside the blocks filled on the GPU, each block filled on the GPU as the streamer packs it.
    `before_stream(model)` runs before the streamer is made (e.g. to inject adapters)."""
    import flame_core as flame
    import flame_nn
    from flame_models.flux import Flux
    with flame_nn.empty_init(device="cuda", dtype=flame.bfloat16):
        model = Flux(params)
    if before_stream is not None:
        before_stream(model)

    def fill(module, seed):
        g = flame.Generator("cuda").manual_seed(seed)
        state = {}
        for name, prm in module.named_parameters():
            if prm.is_meta:
                state[name] = (flame.ones(*prm.shape, dtype=flame.bfloat16, device="cuda") if name.endswith(".scale")
                               else (flame.randn(*prm.shape, generator=g, device="cuda") * 0.02).to(flame.bfloat16))
        module.load_state_dict(state, strict=False, assign=True)
    for name, child in model.named_children():
        if name not in ("double_blocks", "single_blocks"):
            fill(child, 7)
    index = {id(b): i for i, b in enumerate([*model.double_blocks, *model.single_blocks])}
    streamer = flame_nn.offload.BlockStreamer.for_model(
        model, device="cuda", prepare=lambda block: fill(block, 1000 + index[id(block)]), **streamer_kw)
    model.enable_gradient_checkpointing(True)
    model.train()
    return model, streamer


class Run:
    """One storage's model, streamer, optimizer and step functions."""

    def __init__(self, res, storage, size, small, graph, offload=None):
        import flame_core as flame
        import flame_core.memory as M
        import flame_nn
        from flame_models.flux import FluxParams
        from flame_models.flux.lora_keys import TARGET_PRESETS, name_map_for
        from flame_nn import adapters as A
        self.res, self.storage = res, storage
        self.offload = offload  # auto_fit's offload_activations: None (as the budget needs), True, False

        def add_lora(model):  # fp32 adapters on the GPU; base frozen
            A.inject_adapters(model, TARGET_PRESETS["attention"], "lora", rank=16, alpha=16.0,
                              name_map=name_map_for(model.params), generator=flame.Generator("cpu").manual_seed(3))
        self.model, self.streamer = streamed_flux(FluxParams(depth=2, depth_single_blocks=4) if small else "flux-dev",
                                                  add_lora, quantize="fp8" if storage in ("fp8", "fp8c") else None,
                                                  fp8_compute=storage == "fp8c", profile=True)
        self.lora = A.adapter_parameters(self.model)
        self.opt = flame_nn.optim.AdamW(self.lora, lr=1e-4)
        self.args, self.target = common.flame_flux_inputs(size, guidance=1.0)
        self.graph = graph
        res.log(f"{storage}_block_GiB_total", common.gib(sum(self.streamer.block_bytes(i)
                                                             for i in range(len(self.streamer))), 3))
        res.log(f"{storage}_lora_params", sum(q.numel() for q in self.lora))
        res.log(f"{storage}_device_GiB_after_build", common.gib(M.memory_allocated(), 3))

    def fwd_bwd(self):
        import flame_core as flame
        with flame.amp.autocast("cuda", dtype=flame.bfloat16):
            out = self.model(**self.args)
        loss = ((out.float() - self.target) ** 2).mean()
        loss.backward()
        self.streamer.join()  # in a capture: the copy stream's branch joins back before the capture ends
        return loss.detach()

    def measure(self):  # auto_fit's step: forward + backward, no update
        self.fwd_bwd()
        self.opt.zero_grad()

    def step(self):
        self.fwd_bwd()
        self.opt.step()
        self.opt.zero_grad()

    def graph_step(self):
        """(step, graphed function): forward + backward replayed as a CUDA graph after 2 eager calls, AdamW eager on
        the gradients the replay accumulated (kept, zeroed: the graph writes into them)."""
        import flame_core as flame
        run = flame.cuda.graphed(self.fwd_bwd, warmup=2)

        def gstep():
            self.streamer.prime()  # the slots as every step starts
            run()
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        return gstep, run

    def timed(self, tag, step, warmup):
        """Step time, pool and driver peaks over the timed steps."""
        import flame_core.memory as M
        for _ in range(warmup):
            step()
        common.synchronize()
        M.reset_peak_memory_stats()
        with DevicePeak() as dp, common.GpuClocks() as clk:
            ms, _, all_ms = common.cuda_ms(step, self.repeats, warmup=0)
        self.res.log(f"{tag}_clocks", clk.summary)
        self.res.log(f"{tag}_step_ms", round(ms, 1))
        self.res.log(f"{tag}_step_ms_all", [round(x, 1) for x in all_ms])
        self.res.log(f"{tag}_pool_peak_reserved_GiB", common.gib(M.max_memory_reserved(), 3))
        self.res.log(f"{tag}_driver_peak_GiB", common.gib(dp.peak, 3))
        return ms

    def config(self, budget, repeats, warmup, resident=None):
        """One budget (None: every block resident). Returns (eager ms, graph ms) or (None, None)."""
        import flame_core.memory as M
        from flame_nn.offload import MemoryBudgetError
        res, tag, self.repeats = self.res, f"{self.storage}_resident" if budget is None else \
            f"{self.storage}_{budget}GiB", repeats
        M.set_memory_limit(None)
        if budget is None:
            self.streamer.set_resident("all")
            res.log(f"{tag}_resident_blocks", len(self.streamer.resident))
        else:
            # AdamW moments are made at the first optimizer step: count them unless they exist already
            extra = 0 if self.opt.state else 8 * sum(q.numel() for q in self.lora)
            try:
                rep = self.streamer.auto_fit(f"{budget}GiB", self.measure, extra_bytes=extra,
                                             offload_activations=self.offload)
            except MemoryBudgetError as e:
                res.log(f"{tag}_fit", f"does not fit: {e}")
                return None, None
            print(rep, flush=True)
            res.log(f"{tag}_resident_blocks", len(rep.resident))
            res.log(f"{tag}_streamed_blocks", len(rep.streamed))
            res.log(f"{tag}_minimum_GiB", common.gib(rep.minimum, 3))
            res.log(f"{tag}_fit_verify_peaks_GiB", [common.gib(p, 3) for p in rep.verify_peaks])
            res.log(f"{tag}_offload_activations", rep.offload_activations)
            res.log(f"{tag}_offloaded_GiB_per_step", common.gib(rep.offloaded_bytes, 3))
            res.log(f"{tag}_outside_fp8", len(rep.outside_fp8))
            res.log(f"{tag}_activation_host_GiB", common.gib(rep.activation_host_bytes, 3))
            res.log(f"{tag}_host_pinned_GiB", common.gib(rep.host_pinned_bytes, 3))   # the least host RAM
            res.log(f"{tag}_fit_plan", str(rep.plan))
        self.streamer.reset_stats()
        ms = self.timed(tag, self.step, warmup)
        copies = self.streamer.transfer_log()
        nbytes, secs = sum(n for _, n in copies) / repeats, sum(s for s, _ in copies) / repeats
        res.log(f"{tag}_h2d_GB_per_step", round(nbytes / 1e9, 2))
        res.log(f"{tag}_h2d_s_per_step", round(secs, 4))
        if secs > 0:
            res.log(f"{tag}_h2d_GBps", round(nbytes / secs / 1e9, 1))
            if resident is not None:
                res.log(f"{tag}_hidden_share", round(max(0.0, 1 - max(0.0, ms - resident[0]) / 1e3 / secs), 3))
        gms = self.graph_config(tag, secs, resident, None if budget is None else budget * 2 ** 30) \
            if self.graph else None
        M.set_memory_limit(None)
        return ms, gms

    def graph_config(self, tag, h2d_secs, resident, budget_bytes=None):
        """The configuration with forward + backward as a CUDA graph, under the same pool limit; as the trainer does,
        a capture that runs out of memory streams more blocks and captures again, and after a capture the memory
        it added outside the pool comes off the pool's limit (flame_nn.offload.fit_outside_growth: blocks demoted
        and captured again while the pool holds more)."""
        import flame_core as flame
        from flame_core.errors import OutOfMemoryError
        from flame_nn.offload import demote, fit_outside_growth
        gstep, run = self.graph_step()
        ms = None
        try:
            demoted = rounds = 0
            while True:
                try:
                    for _ in range(3):  # two eager calls, then the capture (+ its first replay)
                        gstep()
                    dev = flame.device(self.streamer.device)
                    fit = None if run.graph is None else fit_outside_growth(self.streamer, budget_bytes, dev,
                                                                            3 - rounds)
                    if fit:
                        self.res.log(f"{tag}_graph_outside_growth", fit.words())
                    if not (fit and fit.demoted):
                        break
                    demoted, rounds = demoted + len(fit.demoted), rounds + fit.rounds
                except OutOfMemoryError as e:
                    if run.graph is not None or run.calls <= run.warmup or rounds >= 3:
                        raise
                    self.res.log(f"{tag}_graph_capture_oom", _first_line(e))
                    fit = None
                run.reset()
                gc.collect()
                self.streamer.invalidate_slots()
                if fit is None:  # the capture ran out of memory
                    demoted, rounds = demoted + len(demote(self.streamer)), rounds + 1
                gstep, run = self.graph_step()
            if run.graph is None:  # never time an eager step as the graph's
                raise RuntimeError("the step was not captured: flame.cuda.graphed ran it eagerly")
            self.res.log(f"{tag}_graph_demoted", demoted)
            self.res.log(f"{tag}_graph_resident_blocks", len(self.streamer.resident))
            ms = self.timed(f"{tag}_graph", gstep, 1)
            g = self.streamer.graph_stats
            moved = g is not None and self.streamer.streamed
            if g is not None:  # (None: the streamer saw no capture -- the step ran eagerly)
                self.res.log(f"{tag}_graph_h2d_GB_per_step", round(g["bytes_h2d"] / 1e9, 2) if moved else 0.0)
            self.res.log(f"{tag}_graph_capture_loads", None if g is None else g["loads"])
            if moved and resident is not None and resident[1] is not None and h2d_secs > 0:
                self.res.log(f"{tag}_graph_hidden_share",
                             round(max(0.0, 1 - max(0.0, ms - resident[1]) / 1e3 / h2d_secs), 3))
        except Exception as e:
            traceback.print_exc()
            self.res.log(f"{tag}_graph_error", _first_line(e))
        finally:
            run.reset()  # the graph's private memory goes back before the next configuration
            gc.collect()
            self.streamer.invalidate_slots()  # a capture that failed part-way recorded loads that never ran
            common.synchronize()
        return ms

    def release(self):
        import flame_core.memory as M
        del self.model, self.streamer, self.opt, self.lora, self.args, self.target
        gc.collect()
        common.synchronize()
        M.empty_cache()
        M.empty_pinned_cache()


def flame_part(res, storage, budgets, a, ref_out):
    import flame_core as flame
    import flame_core.memory as M
    run = Run(res, storage, a.size, a.small, a.graph)
    resident = run.config(None, a.repeats, a.warmup)
    with flame.no_grad(), flame.amp.autocast("cuda", dtype=flame.bfloat16):  # the forward at these weights
        out = run.model(**run.args).float().numpy()
    if ref_out:
        ref = ref_out[0]
        res.log(f"{storage}_forward_rel_error_vs_bf16", round(float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
                                                              4))
    for b in budgets:
        try:
            run.config(b, a.repeats, a.warmup, resident)
        except Exception as e:
            traceback.print_exc()
            res.log(f"{storage}_{b}GiB_error", _first_line(e))
            M.set_memory_limit(None)
    res.log(f"{storage}_streamer", repr(run.streamer))
    run.release()
    ref_out.append(out)


def layerwise_part(res, depth, single, budget, a):
    """Full fine-tuning (every weight trained) under a pool limit of `budget` GiB: the blocks stream with their
    trainable weights, LayerwiseAdamW updates each block inside backward from AdamW state in pinned host memory, the
    parts outside the blocks train with a plain AdamW on the GPU."""
    import flame_core as flame
    import flame_core.memory as M
    import flame_nn
    from flame_models.flux import FluxParams
    model, streamer = streamed_flux(FluxParams(depth=depth, depth_single_blocks=single), stream_trainable=True)
    rest_params = [p for n, p in model.named_parameters() if not n.startswith(("double_blocks.", "single_blocks."))]
    n = sum(p.numel() for b in streamer.blocks for p in b.parameters()) + sum(p.numel() for p in rest_params)
    lw = flame_nn.offload.LayerwiseAdamW(streamer, lr=1e-5, weight_decay=0.01)
    rest = flame_nn.optim.AdamW(rest_params, lr=1e-5, weight_decay=0.01)
    args, target = common.flame_flux_inputs(a.size, guidance=1.0)
    tag = f"layerwise_{depth}d{single}s"
    res.log(f"{tag}_params_B", round(n / 1e9, 3))
    res.log(f"{tag}_plain_state_GiB_computed", common.gib(n * (2 + 2 + 8), 3))  # bf16 weights, grads; fp32 moments

    def step():
        with flame.amp.autocast("cuda", dtype=flame.bfloat16):
            out = model(**args)
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        for opt in (lw, rest):
            opt.step()
            opt.zero_grad()
        return loss
    M.set_memory_limit(int(budget * GiB))
    try:
        res.log(f"{tag}_warmup_losses", [round(float(step().item()), 5) for _ in range(a.warmup)])
        common.synchronize()
        M.reset_peak_memory_stats()
        with DevicePeak() as dp:
            ms, _, all_ms = common.cuda_ms(step, a.repeats, warmup=0)
        res.log(f"{tag}_step_ms", round(ms, 1))
        res.log(f"{tag}_step_ms_all", [round(x, 1) for x in all_ms])
        res.log(f"{tag}_pool_peak_reserved_GiB", common.gib(M.max_memory_reserved(), 3))
        res.log(f"{tag}_driver_peak_GiB", common.gib(dp.peak, 3))
    finally:
        M.set_memory_limit(None)
        model = streamer = lw = rest = None  # frees them (rebound, not deleted: step() uses the names)
        gc.collect()
        M.empty_cache()
        M.empty_pinned_cache()


def peer_part(res, a):
    import flux_lora
    peer = common.Results("flux_lora_peer")
    flux_lora.diffusers_part(peer, [(a.size, True)], a.repeats, a.warmup, blocks=(2, 4) if a.small else None,
                             peers=(a.peer,))
    key = "diffusers" if a.peer == "eager" else "compiled"
    res.log("peer", f"diffusers+PEFT {a.peer}, checkpointing, unconstrained")
    res.log("peer_step_ms", peer.get(f"{key}_step_{a.size}_ckpt_ms"))
    res.log("peer_peak_allocated_GiB", peer.get(f"{key}_step_{a.size}_ckpt_peak_GiB"))


def report(res, budgets, fp8_budgets, fp8c_budgets=()):
    peer = res.get("peer_step_ms")
    peer = peer if isinstance(peer, float) else None
    rows = []
    for storage, bs in (("bf16", budgets), ("fp8", fp8_budgets), ("fp8c", fp8c_budgets)):
        if storage == "fp8c" and not bs:
            continue
        for b in [None] + list(bs):
            tag = f"{storage}_resident" if b is None else f"{storage}_{b}GiB"
            ms, g = res.get(f"{tag}_step_ms"), res.get(f"{tag}_graph_step_ms")
            why = res.get(f"{tag}_fit") or res.get(f"{tag}_error")
            if ms is None:
                if why:
                    rows.append([storage, f"{b} GiB", str(why)[:60]])
                continue
            accept = ""
            if (storage, b) in (("bf16", 12), ("fp8", 10)) and peer:  # per mode: step, pool and driver peaks
                accept = " / ".join("-" if t is None else "PASS" if t <= 1.5 * peer and max(
                    res.get(f"{tag}{m}_pool_peak_reserved_GiB") or 1e9, res.get(f"{tag}{m}_driver_peak_GiB") or 1e9)
                    <= b else "FAIL" for t, m in ((ms, ""), (g, "_graph")))
            hid = [res.get(f"{tag}_hidden_share"), res.get(f"{tag}_graph_hidden_share")]
            rows.append([storage, "all resident" if b is None else f"{b} GiB",
                         f"{res.get(f'{tag}_resident_blocks')}/{res.get(f'{tag}_streamed_blocks', 0)}",
                         f"{ms} ({common.ratio(ms, peer, 2)})", f"{g} ({common.ratio(g, peer, 2)})",
                         " / ".join(str(res.get(f"{tag}{m}_pool_peak_reserved_GiB")) for m in ("", "_graph")),
                         " / ".join(str(res.get(f"{tag}{m}_driver_peak_GiB")) for m in ("", "_graph")),
                         res.get(f"{tag}_h2d_GB_per_step", 0), res.get(f"{tag}_h2d_GBps"),
                         " / ".join("-" if h is None else f"{100 * h:.0f}%" for h in hid), accept])
    text = common.table(["storage", "budget", "res/str", "eager ms (x peer)", "graph ms (x peer)", "pool GiB e/g",
                         "driver GiB e/g", "H2D GB", "GB/s", "hidden e/g", "accept e/g"], rows,
                        title=f"\nFlux-dev LoRA step, streamed blocks (peer: {res.get('peer', 'diffusers+PEFT')}, "
                              f"{peer} ms)")
    if "fp8_forward_rel_error_vs_bf16" in res:
        text += f"\nfp8 storage: forward relative error vs bf16 weights {res['fp8_forward_rel_error_vs_bf16']}"
    if "fp8c_forward_rel_error_vs_bf16" in res:
        text += f"\nfp8 compute: forward relative error vs bf16 {res['fp8c_forward_rel_error_vs_bf16']}"
    return text + f"\nH2D ceiling (pinned): {CEILING_GBS} GB/s; hidden = 1 - (step - resident step) / H2D time"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="24,16,12", help="bf16 storage budgets, GiB")
    ap.add_argument("--fp8-budgets", default="24,16,12,10", help="fp8 storage budgets, GiB")
    ap.add_argument("--fp8c-budgets", default=None, help="fp8 storage + fp8 compute budgets, GiB (default: none)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="2 double + 4 single blocks (a smoke run)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer", default="eager", choices=("eager", "compiled"),
                    help="the peer's step: diffusers+PEFT eager or under regional torch.compile (checkpointing on)")
    ap.add_argument("--graph", action="store_true", help="also replay forward+backward as a CUDA graph per config")
    ap.add_argument("--layerwise", default="", help="D,S,B: full fine-tuning of D double + S single blocks under B GiB")
    ap.add_argument("--only-layerwise", action="store_true")
    a = ap.parse_args()
    number = (lambda b: float(b) if "." in b else int(b))
    budgets = [number(b) for b in a.budgets.split(",") if b]
    fp8_budgets = [number(b) for b in a.fp8_budgets.split(",") if b]
    fp8c_budgets = [number(b) for b in a.fp8c_budgets.split(",") if b] if a.fp8c_budgets is not None else []
    res, ref = common.Results("streaming"), []
    parts = []
    if a.layerwise:
        d, s, b = a.layerwise.split(",")
        parts.append((f"layer-wise full fine-tune {d}+{s} blocks, {b} GiB",
                      lambda: layerwise_part(res, int(d), int(s), float(b), a)))
    if not a.only_layerwise:
        parts += [(f"FLAME, {st} storage", (lambda st, bs: lambda: flame_part(res, st, bs, a, ref))(st, bs))
                  for st, bs in (("bf16", budgets), ("fp8", fp8_budgets), ("fp8c", fp8c_budgets))
                  if st != "fp8c" or a.fp8c_budgets is not None]
        if not a.skip_peer:
            parts.append(("diffusers + PEFT (peer)", lambda: peer_part(res, a)))
    failed = common.run_parts(res, parts)
    if not a.only_layerwise:
        print(report(res, budgets, fp8_budgets, fp8c_budgets), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
