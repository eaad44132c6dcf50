"""Block streaming on the GPU: the PEERS.md Flux-dev LoRA step (11.9B params, LoRA r16 a16 on to_q/to_k/to_v/to_out.0
in fp32, AdamW, bf16 autocast, batch 1, T5 512, 1024x1024 = 4096 image tokens, guidance 1.0, gradient checkpointing)
with the blocks streamed from pinned host memory under memory budgets, bf16 and fp8 storage of the frozen weights.

For each storage (bf16, fp8) the model is built block by block (random N(0, 0.02) weights drawn on the GPU one block
at a time, packed into pinned memory, so the whole model is never on the GPU), then:
  resident     every block on the GPU (the reference step time; fp8 output error vs bf16 at the same weights)
  budget B     flame_nn.offload.auto_fit(streamer, B, one forward+backward) picks the resident blocks; B is then the
               pool's limit (allocations over it would fail). Timed: the full step (forward, backward, AdamW).
Figures per run: step time (CUDA events around each step, median of --repeats after --warmup), pool peak
(max_memory_reserved over the timed steps), driver-observed peak (device memory in use, all processes, sampled every
~1 ms by a thread during the timed steps), H2D bytes per step and achieved GB/s (timing events around every copy on
the copy stream) against the 54.9 GB/s pinned ceiling, and the share of transfer time hidden behind compute:
1 - max(0, step - resident step) / transfer time.
The peer (diffusers FluxTransformer2DModel + PEFT, same setup, gradient checkpointing on) runs last in the same process
when diffusers and peft import (--skip-peer to skip); PEERS.md measured 846 ms / 24.7 GiB.
Acceptance (the issue): 12 GiB bf16 and 10 GiB fp8: peak <= budget and step <= 1.5x the peer's step.
--graph: after the eager figures of each configuration, forward + backward replayed as one CUDA graph
(flame_core.cuda.graphed after 2 eager steps; the copies and stream events of the streamed blocks are captured too,
flame_nn.offload.streamer) with AdamW eager on the gradients the replay accumulated, as bench/flux_lora.py --graph;
reported beside the eager figures: step time, pool and driver peaks, H2D bytes per replay (the captured schedule's:
a replay runs no Python to time its copies) and the hidden share against the eager copies' measured time.

Run on the device (diffusers/peft from carried wheels, see shared/PEERS.md):
    PYTHONPATH=$PWD python3 bench/streaming.py [--budgets 24,16,12] [--fp8-budgets 24,16,12,10] [--repeats 5]
                                               [--warmup 2] [--size 1024] [--small] [--skip-peer] [--graph]
Writes $OUT/streaming_bench.json (or ./streaming_bench.json) and prints a table last.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback

import numpy as np

T5_LEN = 512
PEER_MS = 846.0  # PEERS.md: diffusers+PEFT, checkpointing on, 1024x1024
CEILING_GBS = 54.9  # PEERS.md: pinned host->device
GiB = 2 ** 30
R = {}
GRAPH = False  # --graph


def log(key, value):
    R[key] = value
    print(f"{key}: {value}", flush=True)


def section(name):
    print(f"\n== {name} ({time.strftime('%X')})", flush=True)


def gib(n):
    return None if n is None else round(n / GiB, 3)


# ----------------------------------------------------------------------------- measuring
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


def timed_steps(step, repeats, warmup):
    """Median ms of step() between CUDA events after warm-up (synchronised after each step)."""
    import cupy as cp
    for _ in range(warmup):
        step()
    cp.cuda.Device().synchronize()
    ms = []
    for _ in range(repeats):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        step()
        e.record()
        e.synchronize()
        ms.append(cp.cuda.get_elapsed_time(s, e))
    return statistics.median(ms), ms


# ----------------------------------------------------------------------------- FLAME
def random_streamed_flux(params, before_stream=None, **streamer_kw):
    """A Flux of `params` with random N(0, 0.02) bf16 weights (norm scales 1), its blocks in a BlockStreamer (all
    streamed): built under empty_init, the parts outside the blocks filled on the GPU, each block filled on the GPU
    as the streamer packs it into pinned memory -- the whole model is never on the GPU. `before_stream(model)` runs
    before the streamer is made (e.g. to inject adapters)."""
    import flame_core as flame
    import flame_nn
    from flame_models.flux import Flux
    with flame_nn.empty_init(device="cuda", dtype=flame.bfloat16):
        model = Flux(params)
    if before_stream is not None:
        before_stream(model)

    def fill(module, seed):
        g = flame.Generator("cuda").manual_seed(seed)
        with flame.no_grad():
            for name, prm in module.named_parameters():
                if not prm.is_meta:
                    continue
                if name.endswith(".scale"):
                    w = flame.ones(*prm.shape, dtype=flame.bfloat16, device="cuda")
                else:
                    w = (flame.randn(*prm.shape, generator=g, device="cuda") * 0.02).to(flame.bfloat16)
                prm.materialize_(w._data)
    for name, child in model.named_children():
        if name not in ("double_blocks", "single_blocks"):
            fill(child, 7)
    index = {id(b): i for i, b in enumerate([*model.double_blocks, *model.single_blocks])}
    streamer = flame_nn.offload.BlockStreamer.for_model(
        model, device="cuda", prepare=lambda block: fill(block, 1000 + index[id(block)]), **streamer_kw)
    model.enable_gradient_checkpointing(True)
    model.train()
    return model, streamer


def build(storage, small):
    """Flux-dev (random weights, block by block on the GPU) with LoRA, its blocks in a BlockStreamer (all streamed)."""
    import flame_core as flame
    import flame_core.memory as M
    import flame_nn
    from flame_nn import adapters as A
    from flame_models.flux import FluxParams
    from flame_models.flux.lora_keys import TARGET_PRESETS, name_map_for
    t0 = time.perf_counter()

    def add_lora(model):  # fp32 adapters on the GPU; base frozen
        A.inject_adapters(model, TARGET_PRESETS["attention"], "lora", rank=16, alpha=16.0,
                          name_map=name_map_for(model.params), generator=flame.Generator("cpu").manual_seed(3))
    model, streamer = random_streamed_flux(FluxParams(depth=2, depth_single_blocks=4) if small else "flux-dev",
                                           add_lora, quantize="fp8" if storage == "fp8" else None, profile=True)
    lora = A.adapter_parameters(model)
    opt = flame_nn.optim.AdamW(lora, lr=1e-4)
    import cupy as cp
    cp.cuda.Device().synchronize()
    log(f"{storage}_build_s", round(time.perf_counter() - t0, 1))
    log(f"{storage}_block_GiB_total", gib(sum(streamer.block_bytes(i) for i in range(len(streamer)))))
    log(f"{storage}_lora_params", sum(q.numel() for q in lora))
    log(f"{storage}_device_GiB_after_build", gib(M.memory_allocated()))
    return model, streamer, opt, lora


def inputs(size, seed=1):
    import flame_core as flame
    from flame_models.flux import sampling as S
    g = flame.Generator("cuda").manual_seed(seed)
    tokens = (size // 16) ** 2

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
    args = dict(img=rnd(1, tokens, 64), img_ids=S.image_ids(size, size, device="cuda"), txt=rnd(1, T5_LEN, 4096),
                txt_ids=S.text_ids(T5_LEN, device="cuda"), y=rnd(1, 768),
                timesteps=flame.tensor([0.62], dtype=flame.bfloat16, device="cuda"),
                guidance=flame.tensor([1.0], dtype=flame.bfloat16, device="cuda"))
    target = flame.randn(1, tokens, 64, generator=g, device="cuda")
    return args, target


def make_steps(model, opt, args, target, streamer=None):
    import flame_core as flame
    from flame_core.amp import autocast

    def fwd_bwd():
        with autocast("cuda", dtype=flame.bfloat16):
            out = model(**args)
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        if streamer is not None:
            streamer.join()  # in a capture: the copy stream's branch joins back before the capture ends
        return loss.detach()

    def measure():  # auto-fit's step: forward + backward, no update
        fwd_bwd()
        opt.zero_grad()

    def step():  # the timed training step
        fwd_bwd()
        opt.step()
        opt.zero_grad()

    def graph_step_factory():
        """(step, graphed function): forward + backward replayed as a CUDA graph after 2 eager calls (the third
        captures), AdamW eager on the gradients the replay accumulated (kept, zeroed: the graph writes into them)."""
        run = flame.cuda.graphed(fwd_bwd, warmup=2)

        def gstep():
            streamer.prime()  # the slots as every step starts (one event when nothing moved)
            run()
            opt.step()
            opt.zero_grad(set_to_none=False)
        return gstep, run
    return measure, step, graph_step_factory


def streamer_opt_state(lora):
    return bool(_OPT and _OPT[0].state)


_OPT = []


def run_config(tag, streamer, step, measure, lora, budget, repeats, warmup, resident_ms=None, graph_factory=None,
               resident_graph_ms=None):
    """One budget (None: every block resident). Returns (eager step ms, graph step ms or None)."""
    import cupy as cp
    import flame_core.memory as M
    from flame_nn.offload import MemoryBudgetError
    M.set_memory_limit(None)
    if budget is None:
        streamer.set_resident("all")
        log(f"{tag}_resident_blocks", len(streamer.resident))
    else:
        # AdamW moments are made at the first optimizer step: count them unless they exist already
        extra = 0 if streamer_opt_state(lora) else 8 * sum(q.numel() for q in lora)
        try:
            rep = streamer.auto_fit(f"{budget}GiB", measure, extra_bytes=extra)
        except MemoryBudgetError as e:
            log(f"{tag}_fit", f"does not fit: {e}")
            log(f"{tag}_minimum_GiB", gib(e.minimum))
            return None, None
        print(rep, flush=True)
        log(f"{tag}_resident_blocks", len(rep.resident))
        log(f"{tag}_streamed_blocks", len(rep.streamed))
        log(f"{tag}_minimum_GiB", gib(rep.minimum))
        log(f"{tag}_overhead_outside_pool_GiB", gib(rep.overhead))
        log(f"{tag}_fit_verified_pool_peak_GiB", gib(rep.measured_peak))
        log(f"{tag}_fit_verify_peaks_GiB", [gib(p) for p in rep.verify_peaks])
        log(f"{tag}_fit_demoted", rep.demoted)
    for _ in range(warmup):
        step()
    cp.cuda.Device().synchronize()
    streamer.reset_stats()
    M.reset_peak_memory_stats()
    before = M.memory_stats()
    with DevicePeak() as dp:
        ms, all_ms = timed_steps(step, repeats, 0)
    after = M.memory_stats()
    # pool churn under the limit: retries release the cache and call cudaMalloc/cudaFree again (slow)
    log(f"{tag}_pool_per_step", {k: round((after[k] - before[k]) / repeats, 1) for k in (
        "num_alloc_retries", "num_device_alloc", "num_device_free", "cache_misses")})
    log(f"{tag}_step_ms", round(ms, 1))
    log(f"{tag}_step_ms_all", [round(x, 1) for x in all_ms])
    log(f"{tag}_pool_peak_reserved_GiB", gib(M.max_memory_reserved()))
    log(f"{tag}_pool_peak_allocated_GiB", gib(M.max_memory_allocated()))
    log(f"{tag}_driver_peak_GiB", gib(dp.peak))
    copies = streamer.transfer_log()
    nbytes = sum(n for _, n in copies) / repeats
    secs = sum(s for s, _ in copies) / repeats
    log(f"{tag}_h2d_GB_per_step", round(nbytes / 1e9, 2))
    if secs > 0:
        log(f"{tag}_h2d_ms_per_step", round(secs * 1e3, 1))
        log(f"{tag}_h2d_GBps", round(nbytes / secs / 1e9, 1))
        if resident_ms is not None:
            exposed = max(0.0, ms - resident_ms) / 1e3
            log(f"{tag}_hidden_share", round(max(0.0, 1 - exposed / secs), 3))
    gms = None
    if graph_factory is not None:
        gms = run_graph(tag, streamer, graph_factory, repeats, secs, resident_graph_ms)
    M.set_memory_limit(None)
    return ms, gms


def _first_line(e):
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def run_graph(tag, streamer, graph_factory, repeats, h2d_secs, resident_graph_ms):
    """The same configuration with forward + backward replayed as a CUDA graph (under the same pool limit)."""
    import cupy as cp
    import flame_core.memory as M
    from flame_core.errors import OutOfMemoryError
    from flame_nn.offload import demote
    gstep, run = graph_factory()
    try:
        demoted = 0
        while True:  # as the trainer: a capture over the budget streams more blocks (flame_nn.offload.demote)
            try:
                for _ in range(3):  # two eager calls, then the capture (+ its first replay)
                    gstep()
                break
            except OutOfMemoryError as e:
                if run.graph is not None or run.calls <= run.warmup or demoted >= 3:
                    raise
                log(f"{tag}_graph_capture_oom", _first_line(e))
            run.reset()
            gc.collect()
            streamer.invalidate_slots()
            demoted += len(demote(streamer))
            gstep, run = graph_factory()
        cp.cuda.Device().synchronize()
        log(f"{tag}_graph_captured", run.graph is not None)
        log(f"{tag}_graph_demoted", demoted)
        log(f"{tag}_graph_resident_blocks", len(streamer.resident))
        M.reset_peak_memory_stats()
        with DevicePeak() as dp:
            ms, all_ms = timed_steps(gstep, repeats, 1)
        log(f"{tag}_graph_step_ms", round(ms, 1))
        log(f"{tag}_graph_step_ms_all", [round(x, 1) for x in all_ms])
        log(f"{tag}_graph_pool_peak_reserved_GiB", gib(M.max_memory_reserved()))
        log(f"{tag}_graph_driver_peak_GiB", gib(dp.peak))
        g = streamer.graph_stats
        if g is not None and streamer.streamed:
            log(f"{tag}_graph_h2d_GB_per_step", round(g["bytes_h2d"] / 1e9, 2))
            log(f"{tag}_graph_cyclic", g["start"] == g["end"])
            if resident_graph_ms is not None and h2d_secs > 0:  # the same copies as eager: their measured time
                exposed = max(0.0, ms - resident_graph_ms) / 1e3
                log(f"{tag}_graph_hidden_share", round(max(0.0, 1 - exposed / h2d_secs), 3))
        else:
            log(f"{tag}_graph_h2d_GB_per_step", 0.0)
    except Exception as e:
        traceback.print_exc()
        log(f"{tag}_graph_error", _first_line(e))
        ms = None
    finally:
        run.reset()  # the graph's private memory goes back before the next configuration
        gc.collect()
        streamer.invalidate_slots()  # a capture that failed part-way recorded loads that never ran
        cp.cuda.Device().synchronize()
    return ms


def flame_part(storage, budgets, size, repeats, warmup, small, ref_out=None):
    import cupy as cp
    import flame_core as flame
    import flame_core.memory as M
    model, streamer, opt, lora = build(storage, small)
    args, target = inputs(size)
    measure, step, graph_factory = make_steps(model, opt, args, target, streamer)
    graph_factory = graph_factory if GRAPH else None
    _OPT[:] = [opt]
    out = None
    res_ms, res_gms = run_config(f"{storage}_resident", streamer, step, measure, lora, None, repeats, warmup,
                                 graph_factory=graph_factory)
    with flame.no_grad():  # the forward output at these weights (for the fp8 error against bf16)
        from flame_core.amp import autocast
        with autocast("cuda", dtype=flame.bfloat16):
            out = model(**args).float().cpu().numpy()
    if ref_out is not None:
        err = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out))
        log(f"{storage}_forward_rel_error_vs_bf16", round(err, 4))
        cos = float((out * ref_out).sum() / np.linalg.norm(out) / np.linalg.norm(ref_out))
        log(f"{storage}_forward_cosine_vs_bf16", round(cos, 5))
    for b in budgets:
        try:
            run_config(f"{storage}_{b}GiB", streamer, step, measure, lora, b, repeats, warmup, res_ms,
                       graph_factory=graph_factory, resident_graph_ms=res_gms)
        except Exception as e:
            traceback.print_exc()
            log(f"{storage}_{b}GiB_error", _first_line(e))
            M.set_memory_limit(None)
    log(f"{storage}_streamer", repr(streamer))
    del model, streamer, opt, lora, measure, step, graph_factory, args, target
    _OPT.clear()
    gc.collect()
    cp.cuda.Device().synchronize()
    M.empty_cache()
    M.empty_pinned_cache()
    return out


# ----------------------------------------------------------------------------- layer-wise full fine-tune
def layerwise_part(depth, single, budget, size, repeats, warmup):
    """Full fine-tuning (every weight trained) of a Flux-dev-width model of `depth` double + `single` single blocks
    under a pool limit of `budget` GiB: the blocks stream from pinned memory with their trainable weights,
    LayerwiseAdamW updates each block inside backward from AdamW state in pinned host memory (fp32 moments and
    masters), the parts outside the blocks train with a plain AdamW on the GPU."""
    import cupy as cp
    import flame_core as flame
    import flame_core.memory as M
    import flame_nn
    from flame_core.amp import autocast
    from flame_models.flux import FluxParams
    t0 = time.perf_counter()
    model, streamer = random_streamed_flux(FluxParams(depth=depth, depth_single_blocks=single), stream_trainable=True)
    n_block = sum(p.numel() for b in streamer.blocks for p in b.parameters())
    rest_params = [p for n, p in model.named_parameters() if not n.startswith(("double_blocks.", "single_blocks."))]
    n_rest = sum(p.numel() for p in rest_params)
    lw = flame_nn.offload.LayerwiseAdamW(streamer, lr=1e-5, weight_decay=0.01)
    rest = flame_nn.optim.AdamW(rest_params, lr=1e-5, weight_decay=0.01)
    args, target = inputs(size)
    cp.cuda.Device().synchronize()
    tag = f"layerwise_{depth}d{single}s"
    log(f"{tag}_build_s", round(time.perf_counter() - t0, 1))
    log(f"{tag}_params_B", round((n_block + n_rest) / 1e9, 3))
    # what a plain resident full fine-tune holds before activations: bf16 weights and gradients, fp32 AdamW moments
    log(f"{tag}_plain_state_GiB_computed", gib((n_block + n_rest) * (2 + 2 + 8)))

    def step():
        with autocast("cuda", dtype=flame.bfloat16):
            out = model(**args)
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        lw.step()
        rest.step()
        lw.zero_grad()
        rest.zero_grad()
        return loss
    M.set_memory_limit(int(budget * GiB))
    try:
        losses = [float(step().item()) for _ in range(warmup)]
        cp.cuda.Device().synchronize()
        M.reset_peak_memory_stats()
        with DevicePeak() as dp:
            ms, all_ms = timed_steps(step, repeats, 0)
        log(f"{tag}_budget_GiB", budget)
        log(f"{tag}_step_ms", round(ms, 1))
        log(f"{tag}_step_ms_all", [round(x, 1) for x in all_ms])
        log(f"{tag}_pool_peak_reserved_GiB", gib(M.max_memory_reserved()))
        log(f"{tag}_driver_peak_GiB", gib(dp.peak))
        log(f"{tag}_warmup_losses", [round(x, 5) for x in losses])
        log(f"{tag}_loss_after", round(float(step().item()), 5))
    finally:
        M.set_memory_limit(None)  # the caller frees what this built once it has returned


# ----------------------------------------------------------------------------- the peer
def peer_part(size, repeats, warmup, small):
    """diffusers+PEFT with checkpointing at `size`: the peer of bench/flux_lora.py (one definition of the setup)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import flux_lora
    flux_lora.diffusers_part([(size, True)], repeats, warmup, blocks=(2, 4) if small else None)
    tag = f"{size}_ckpt"
    if isinstance(flux_lora.R.get(f"diffusers_step_{tag}_ms"), float):
        log("peer_step_ms", flux_lora.R[f"diffusers_step_{tag}_ms"])
        log("peer_peak_allocated_GiB", flux_lora.R[f"diffusers_step_{tag}_peak_GiB"])


# ----------------------------------------------------------------------------- report
def table(budgets, fp8_budgets):
    peer = R.get("peer_step_ms") or PEER_MS
    src = "measured" if R.get("peer_step_ms") else "PEERS.md"
    graph = any(k.endswith("_graph_step_ms") or k.endswith("_graph_error") for k in R)
    lines = ["", f"Flux-dev LoRA step, 1024x1024, batch 1, streamed blocks (peer: diffusers+PEFT checkpointing on, "
                 f"{peer} ms, {src})",
             f"{'storage':>7} {'budget':>8} | {'res/str':>7} | {'step ms':>8} | {'x peer':>6} | {'pool GiB':>8} | "
             f"{'driver GiB':>10} | {'H2D GB':>6} | {'GB/s':>5} | {'% ceil':>6} | {'hidden':>6} | accept"
             + (f" | {'graph ms':>8} | {'x peer':>6} | {'pool GiB':>8} | {'driver GiB':>10} | {'hidden':>6} | accept"
                if graph else "")]
    for storage, bs in (("bf16", budgets), ("fp8", fp8_budgets)):
        for b in [None] + list(bs):
            tag = f"{storage}_resident" if b is None else f"{storage}_{b}GiB"
            ms = R.get(f"{tag}_step_ms")
            if ms is None and f"{tag}_fit" not in R and f"{tag}_error" not in R:
                continue
            bud = "all-res" if b is None else f"{b} GiB"
            if ms is None:
                why = R.get(f"{tag}_fit") or R.get(f"{tag}_error")
                lines.append(f"{storage:>7} {bud:>8} | {str(why)[:110]}")
                continue
            res = f"{R.get(f'{tag}_resident_blocks', '-')}/{R.get(f'{tag}_streamed_blocks', 0)}"
            pool, drv = R.get(f"{tag}_pool_peak_reserved_GiB"), R.get(f"{tag}_driver_peak_GiB")
            gbs = R.get(f"{tag}_h2d_GBps")
            hid = R.get(f"{tag}_hidden_share")
            acc = ""
            accept = (storage, b) in (("bf16", 12), ("fp8", 10))
            if accept:
                ok = ms <= 1.5 * peer and pool is not None and pool <= b and drv is not None and drv <= b
                acc = "PASS" if ok else "FAIL"
            line = (f"{storage:>7} {bud:>8} | {res:>7} | {ms:>8.1f} | {ms / peer:>6.2f} | {pool or '-':>8} | "
                    f"{drv or '-':>10} | {R.get(f'{tag}_h2d_GB_per_step', 0):>6} | {gbs or '-':>5} | "
                    f"{(f'{100 * gbs / CEILING_GBS:.0f}%' if gbs else '-'):>6} | "
                    f"{(f'{100 * hid:.0f}%' if hid is not None else '-'):>6} | {acc:>6}")
            if graph:
                gms = R.get(f"{tag}_graph_step_ms")
                if gms is None:
                    line += f" | graph: {str(R.get(f'{tag}_graph_error', '-'))[:80]}"
                else:
                    gpool, gdrv = R.get(f"{tag}_graph_pool_peak_reserved_GiB"), R.get(f"{tag}_graph_driver_peak_GiB")
                    ghid = R.get(f"{tag}_graph_hidden_share")
                    gacc = ""
                    if accept:
                        ok = gms <= 1.5 * peer and gpool is not None and gpool <= b and gdrv is not None and gdrv <= b
                        gacc = "PASS" if ok else "FAIL"
                    line += (f" | {gms:>8.1f} | {gms / peer:>6.2f} | {gpool or '-':>8} | {gdrv or '-':>10} | "
                             f"{(f'{100 * ghid:.0f}%' if ghid is not None else '-'):>6} | {gacc}")
                    if R.get(f"{tag}_graph_demoted"):
                        line += f" ({R[f'{tag}_graph_demoted']} demoted: {R[f'{tag}_graph_resident_blocks']} resident)"
            lines.append(line)
    if "fp8_forward_rel_error_vs_bf16" in R:
        lines.append(f"fp8 storage: forward output relative error vs bf16 weights {R['fp8_forward_rel_error_vs_bf16']}"
                     f" (cosine {R.get('fp8_forward_cosine_vs_bf16')})")
    lines.append("driver GiB: device memory in use (all processes) sampled during the timed steps; pool GiB: FLAME "
                 "pool reserved peak; hidden: 1 - (step - all-resident step) / H2D time")
    if graph:
        lines.append("graph: forward + backward replayed as one CUDA graph (copies included), AdamW eager; its "
                     "hidden share uses the graph's all-resident step and the eager copies' measured time")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="24,16,12", help="bf16 storage budgets, GiB")
    ap.add_argument("--fp8-budgets", default="24,16,12,10", help="fp8 storage budgets, GiB")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="2 double + 4 single blocks (a smoke run)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--graph", action="store_true", help="also replay forward+backward as a CUDA graph per config")
    ap.add_argument("--layerwise", default="", help="D,S,B: also full fine-tuning of a D double + S single block "
                                                    "Flux-dev-width model under a B GiB pool limit (LayerwiseAdamW)")
    ap.add_argument("--only-layerwise", action="store_true")
    a = ap.parse_args()
    global GRAPH
    GRAPH = a.graph
    budgets = [float(b) if "." in b else int(b) for b in a.budgets.split(",") if b]
    fp8_budgets = [float(b) if "." in b else int(b) for b in a.fp8_budgets.split(",") if b]
    out = os.path.join(os.environ.get("OUT", "."), "streaming_bench.json")
    failed = False
    log("size", a.size)
    log("graph", GRAPH)
    ref = None
    if a.layerwise:
        d, s_, b = a.layerwise.split(",")
        section(f"layer-wise full fine-tune, {d} double + {s_} single blocks, {b} GiB")
        try:
            layerwise_part(int(d), int(s_), float(b), a.size, a.repeats, a.warmup)
        except Exception:
            traceback.print_exc()
            failed = True
        import cupy as cp
        import flame_core.memory as M
        gc.collect()
        cp.cuda.Device().synchronize()
        M.empty_cache()
        M.empty_pinned_cache()
        if a.only_layerwise:
            json.dump(R, open(out, "w"), indent=1, default=str)
            sys.exit(1 if failed else 0)
    for storage, bs in (("bf16", budgets), ("fp8", fp8_budgets)):
        section(f"FLAME, {storage} storage")
        try:
            o = flame_part(storage, bs, a.size, a.repeats, a.warmup, a.small, ref_out=ref)
            ref = o if storage == "bf16" else ref
        except Exception:
            traceback.print_exc()
            failed = True
        json.dump(R, open(out, "w"), indent=1, default=str)
    if not a.skip_peer:
        section("diffusers + PEFT (peer)")
        try:
            peer_part(a.size, a.repeats, a.warmup, a.small)
        except ImportError as e:
            log("peer", f"not run: {e}")
        except Exception:
            traceback.print_exc()
            failed = True
    json.dump(R, open(out, "w"), indent=1, default=str)
    print(table(budgets, fp8_budgets), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
