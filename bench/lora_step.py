"""What the LoRA-step benchmarks share (flux_lora.py, sd3_lora.py, sdxl_lora.py): random real-size models, FLAME's
timed steps and the diffusers + PEFT peer's, and the report table.

Protocol (every script): random init, bf16 frozen base; LoRA r=16 alpha=16 on to_q / to_k / to_v / to_out.0 (in
FLAME the same rows of SAI's / BFL's fused qkv and the out projections); fp32 adapter parameters; AdamW lr 1e-4;
bf16 autocast; batch 1; MSE against a random target. CUDA events around whole steps (forward, backward, optimizer
step, zero_grad) after warm-up, median of repeats. Peak: the framework's max allocated bytes over the timed steps
(weights included); with --graph FLAME's over the capture step (a replay allocates nothing: its buffers are allocated
and freed once, at capture). Max reserved bytes (FLAME's pool / torch's caching allocator) beside them. FLAME runs
first and releases its memory before diffusers builds its model. FLAME's adapter gradients live in lazy flat buffers
(grad_pool.register(lazy=True)): allocated as backward reaches them and released by zero_grad(set_to_none=True), as
the peer's (PEFT + torch: AccumulateGrad allocates, set_to_none frees); with --graph the capture allocates them from
the graph's private memory, where they share addresses with activations freed earlier in the step.
"""
import argparse
import gc
import json
import os
import sys

import common
import numpy as np

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def random_init_(model, seed=0, std=0.02, device="cuda", chunk=1 << 26):
    """Fill a model built under flame_nn.empty_init without fragmenting FLAME's pool: each parameter is allocated
    once in its dtype and filled from fixed-size float32 draws (N(0, std); normalisation gains 1, their biases 0),
    so the temporaries are the same size every time and leave no holes between the weights. `chunk`: the draws'
    size (a cpu smoke run of a tiny model takes a small one: every parameter draws at least one chunk)."""
    import flame_core as flame
    from flame_models.training.random_init import _is_norm
    g = flame.Generator(device).manual_seed(seed)
    state = {}
    with flame.no_grad():
        for mname, mod in model.named_modules():
            for pname, prm in mod.named_parameters(recurse=False):
                name = f"{mname}.{pname}" if mname else pname
                w = state[name] = flame.empty(*prm.shape, dtype=prm.dtype, device=device)
                flat = w.view(-1)
                if _is_norm(mname, mod, pname):
                    flat.fill_(1.0 if pname in ("weight", "scale") else 0.0)
                    continue
                for i in range(0, flat.numel(), chunk):
                    n = min(chunk, flat.numel() - i)
                    draw = flame.randn(chunk, generator=g, device=device).mul_(std).to(prm.dtype)
                    flat[i:i + n] = draw[:n]  # chunk-sized temporaries only
                    del draw
    model.load_state_dict(state, assign=True, strict=False)  # the filled tensors become the parameters (no copy)
    return model


def family_model(arch, size, device="cuda", quantize="bf16", cache_transposes=False):
    """(model, name map) of a trainer family's preset (`arch` 'sd3' / 'sdxl', `size` e.g. 'sd3.5-large' or its
    params), random bf16 weights on `device`, frozen; `quantize` (QUANTIZE) applied to its block stacks as the
    trainer's model.quantize / train.fp8_compute do (cache_transposes: quantize_blocks')."""
    import flame_core as flame
    from flame_models.training.family import get_family
    fam = get_family(arch)
    model = fam.empty_model(fam.preset(size), flame.bfloat16, device)
    random_init_(model, device=device)
    model.requires_grad_(False)
    quantize_blocks([model.get_submodule(s) for s in fam.block_stacks(model)], quantize, cache_transposes)
    return model, fam.lora_name_map(model)


QUANTIZE = ("bf16", "fp8", "fp8_compute", "fp8_delayed")


def quantize_blocks(stacks, quantize, cache_transposes=False):
    """The frozen Linears of `stacks` as --quantize names: bf16 (as they are), fp8 (e4m3 storage, dequantised per
    matmul), fp8_compute (e4m3 storage, the matmuls on the fp8 tensor cores, activations scaled by their own amax)
    or fp8_delayed (fp8_compute with delayed scaling of the activations: flame_nn.offload.set_fp8_scaling_).
    cache_transposes (--fp8-cache-transposes; the fp8-compute variants only): every weight's W^T made once and kept
    resident for the input gradient (flame_nn.offload.cache_fp8_transposes_, the trainer's
    train.fp8_cache_transposes) instead of transposed per backward call. Returns the bytes those transposes hold."""
    from flame_nn.offload import cache_fp8_transposes_, quantize_linear_weights_, set_fp8_scaling_
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize: one of {', '.join(QUANTIZE)}, got {quantize!r}")
    held = 0
    if quantize != "bf16":
        for stack in stacks:
            quantize_linear_weights_(stack, compute="fp8" if quantize in FP8_COMPUTE else None)
            if quantize == "fp8_delayed":
                set_fp8_scaling_(stack, "delayed")
            if cache_transposes and quantize in FP8_COMPUTE:
                held += cache_fp8_transposes_(stack)
    return held


FP8_COMPUTE = ("fp8_compute", "fp8_delayed")   # the --quantize variants --fp8-cache-transposes applies to


def variant_prefix(quantize):
    """The results' key prefix of FLAME's --quantize variant ('' for bf16)."""
    return "" if quantize == "bf16" else quantize + "_"


def variant_note(quantize, cache_transposes=False):
    tc = ", W^T cached (--fp8-cache-transposes)" if cache_transposes and quantize in FP8_COMPUTE else ""
    return "" if quantize == "bf16" else f"; FLAME: {quantize}{tc}"


def tag(size, ckpt, prefix=""):
    """The results' key part of one setting: '<prefix>1024_ckpt' (prefix names the model where a script runs
    several, e.g. 'large_'); ckpt True, False or "attn" (checkpointing that keeps each block's attention output:
    '_ckptattn')."""
    return f"{prefix}{size}_{'ckptattn' if ckpt == 'attn' else ('ckpt' if ckpt else 'nockpt')}"


def peer_ckpt(ckpt):
    """The peer's setting for FLAME's: "attn" is FLAME's selective checkpointing, measured against the peer's
    (full) checkpointing."""
    return True if ckpt == "attn" else ckpt


def flame_steps(res, model, name_map, configs, make_step, repeats, warmup, graph=False, prefix="", full=False):
    """Inject the LoRA (full: every weight trains instead, in float32 -- the trainer's network.type full), then time
    steps for each (size, ckpt) of `configs`. make_step(size) -> (fwd_bwd, args): fwd_bwd(*args) runs forward under
    bf16 autocast and backward, returning the detached loss (its tensor arguments are what a CUDA graph replays)."""
    import flame_core as flame
    import flame_core.memory as fmem
    import flame_nn
    from flame_core import grad_pool
    from flame_nn import adapters as A
    if full:
        from flame_models.training import full_finetune
        from flame_models.training.config import NetworkConfig
        full_finetune.make_trainable(model, NetworkConfig(type="full"), name_map, device="cuda", budget=None,
                                     optimizer="adamw")
        lora = [p for _, p in full_finetune.trained_parameters(model)]
        made = lora   # (logged as the count of trained tensors)
    else:
        made = A.inject_adapters(model, TARGETS, "lora", rank=16, alpha=16, name_map=name_map,
                                 generator=flame.Generator("cuda").manual_seed(1))
        lora = A.adapter_parameters(model)
    model.train()
    grad_pool.register(lora, lazy=True)  # gradients resident only from backward to zero_grad, as the peer's
    opt = flame_nn.optim.AdamW(lora, lr=1e-4)
    res.log(f"flame_{prefix}params", sum(q.numel() for q in model.parameters()))
    res.log(f"flame_{prefix}lora_params", sum(q.numel() for q in lora))
    res.log(f"flame_{prefix}adapted_layers", len(made))
    from flame_nn.offload.fp8_transposes import cached_transposes
    cached = cached_transposes(model)   # --fp8-cache-transposes (quantize_blocks): the A/B's side and its memory
    res.log(f"flame_{prefix}fp8_cache_transposes", bool(cached))
    res.log(f"flame_{prefix}fp8_transposes_GiB", sum(c.nbytes for c in cached.values()) / 2**30)
    for size, ckpt in configs:
        t = tag(size, ckpt, prefix)
        model.enable_gradient_checkpointing(bool(ckpt), save=("attention",) if ckpt == "attn" else ())
        fwd_bwd, args = make_step(size)
        losses = []
        # --graph: forward + backward captured as a CUDA graph after 2 eager steps, on `args` themselves (no second
        # copy of the inputs); AdamW runs eagerly on the gradients the replay wrote (one fused launch per buffer)
        run = flame.cuda.graphed(fwd_bwd, warmup=2, enabled=graph, alias_inputs=True)  # args: the same every call

        def step():
            loss = run(*args)
            opt.step()
            # until the capture the gradients go (the capture allocates them in the graph's memory); then they stay:
            # every replay writes them there
            opt.zero_grad(set_to_none=run.graph is None)
            losses.append(loss.clone() if graph else loss)
        try:
            for _ in range(max(warmup, 2)):
                step()
            common.synchronize()
            fmem.reset_peak_memory_stats()
            capture_peak = None
            if graph:  # the capture step: every buffer of the graph is allocated (and freed) once
                step()
                common.synchronize()
                if run.graph is None:  # never time eager steps as the graph's
                    raise RuntimeError("the step was not captured: flame.cuda.graphed ran it eagerly")
                capture_peak = fmem.max_memory_allocated()
                res.log(f"flame_step_{t}_capture_peak_allocated_GiB", common.gib(capture_peak, 3))
                fmem.reset_peak_memory_stats()
            ms = common.cuda_ms(step, repeats, warmup=0)[0]
            lv = [float(v.item()) for v in losses]
            assert all(np.isfinite(lv)), f"non-finite loss {lv}"
            res.log(f"flame_step_{t}_ms", round(ms, 1))
            res.log(f"flame_step_{t}_peak_GiB", common.gib(capture_peak if graph else fmem.max_memory_allocated(), 3))
            res.log(f"flame_step_{t}_peak_reserved_GiB", common.gib(fmem.max_memory_reserved()))
            res.log(f"flame_step_{t}_loss_first_last", (round(lv[0], 4), round(lv[-1], 4)))
        except flame.OutOfMemoryError as ex:
            res.log(f"flame_step_{t}_ms", f"OOM: {str(ex).splitlines()[0]}")
        run.reset()
        args = losses = run = step = fwd_bwd = None  # rebound, not deleted: closures above use the names
        opt.zero_grad()
        gc.collect()
    opt = lora = None  # rebound, not deleted: closures above use the names
    gc.collect()


def trainer_budget_run(res, key, name, arch, size, budget_gib, text_length, warmup, repeats):
    """One family through FLAME's trainer under max_gpu_memory `budget_gib` GiB with fp8 block storage (synthetic
    1024² samples, LoRA r16 on attention, AdamW, checkpointing): logs `{key}_resident_blocks`, `{key}_graphed`,
    `{key}_step_ms`, `{key}_driver_peak_GiB` (polled from the driver) and `{key}_pool_peak_reserved_GiB`."""
    import tempfile

    import flame_core as flame
    from flame_models.training.config import config_from_dict
    from flame_models.training.stages import _DevicePoll
    from flame_models.training.trainer import Trainer
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict({
            "name": name, "training_folder": tmp, "device": "cuda", "max_gpu_memory": f"{budget_gib}GiB",
            "model": {"arch": arch, "name_or_path": None, "size": size, "quantize": True},
            "synthetic": {"num_samples": 8, "height": 1024, "width": 1024, "text_length": text_length},
            "network": {"type": "lora", "linear": 16, "linear_alpha": 16, "target": "attention"},
            "train": {"steps": 1000, "batch_size": 1, "lr": 1e-4, "optimizer": "adamw", "dtype": "bf16",
                      "gradient_checkpointing": True, "disable_sampling": True},
            "sample": {"sample_every": 0}, "save": {"save_every": 10 ** 6}}, check_files=False)
        poll = _DevicePoll(flame.device("cuda"))
        tr = Trainer(cfg, verbose=False).setup()
        res.log(f"{key}_resident_blocks", f"{len(tr.streamer.resident)} of {len(tr.streamer.names)}"
                if tr.streamer is not None else "all")
        for _ in range(max(warmup, 3)):   # the first steps capture the CUDA graph
            tr.train_step()
        ms = common.cuda_ms(tr.train_step, repeats, warmup=0)[0]
        peak = poll.stop()
        res.log(f"{key}_graphed", bool(tr.graphed is not None and tr.graphed.captured))
        res.log(f"{key}_step_ms", round(ms, 1))
        res.log(f"{key}_driver_peak_GiB", common.gib(peak))
        res.log(f"{key}_pool_peak_reserved_GiB", common.gib(flame.memory.max_memory_reserved()))
        del tr
    release_flame()


def trainer_whole_run(res, key, name, arch, size, budget_gib, steps=20, images=8, prompts=2, px=1024, neg=None,
                      device="cuda", dtype="bf16"):
    """A whole run of one family through FLAME's trainer under max_gpu_memory `budget_gib` GiB, random weights at
    `size` (model.size without files: every part drawn at its released size), fp8 block storage: `images` drawn
    images with captions cached (latents and text states), `steps` LoRA r16 (attention) steps with checkpointing
    (CUDA graph after the first), then `prompts` samples at px x px (20 steps; CFG with the negative prompt `neg`
    where the family takes one). Logs `{key}_stages` (seconds, pool peak, driver-observed peak per stage),
    `{key}_driver_peak_GiB` (polled from the driver over the whole run), `{key}_step_ms` (median wall time of the
    steps after the warm-up, from the loss log's clock: the log reads each step's loss, so a step's time includes
    its completion), `{key}_losses`. device "cpu" with a tiny size and budget None: the script's smoke test."""
    import tempfile
    import time

    import flame_core as flame
    from flame_models.flux.demo import draw_dataset
    from flame_models.training.config import config_from_dict
    from flame_models.training.stages import _DevicePoll
    from flame_models.training.trainer import Trainer
    with tempfile.TemporaryDirectory() as tmp:
        folder = draw_dataset(os.path.join(tmp, "images"), images // 2, images - images // 2, size=px)
        sample = {"sample_every": steps, "sample_steps": 20, "width": px, "height": px,
                  "prompts": ["a photo of a red square", "a photo of a blue circle"][:prompts]}
        if neg is not None:
            sample["neg"] = neg
        d = {"name": name, "training_folder": os.path.join(tmp, "runs"), "device": device, "log_every": 1,
             "model": {"arch": arch, "name_or_path": None, "size": size, "quantize": True, "dtype": dtype},
             "datasets": [{"folder_path": folder, "resolution": px}],
             "network": {"type": "lora", "linear": 16, "linear_alpha": 16, "target": "attention"},
             "train": {"steps": steps, "batch_size": 1, "lr": 1e-4, "optimizer": "adamw", "dtype": dtype,
                       "gradient_checkpointing": True, "skip_first_sample": True},
             "sample": sample, "save": {"save_every": steps}}
        if budget_gib is not None:
            d["max_gpu_memory"] = f"{budget_gib}GiB"
        cfg = config_from_dict(d, "bench/lora_step.py")
        poll = _DevicePoll(flame.device(device)) if device == "cuda" else None
        t0 = time.perf_counter()
        result = Trainer(cfg, verbose=False).train()
        res.log(f"{key}_seconds", round(time.perf_counter() - t0, 1))
        res.log(f"{key}_driver_peak_GiB", common.gib(poll.stop()) if poll is not None else None)
        res.log(f"{key}_stages", [{"stage": st["stage"], "seconds": round(st["seconds"], 1),
                                   "pool_peak_GiB": common.gib(st.get("peak_allocated"), 2),
                                   "driver_peak_GiB": common.gib(st.get("device_peak"), 2)}
                                  for st in result["stages"]])
        with open(result["loss_json"]) as f:
            rows = json.load(f)["rows"]  # the trainer's loss log: {"fields": [...], "rows": [...]}
        clock = [r["seconds"] for r in rows]
        per_step = [1e3 * (b - a) for a, b in zip(clock, clock[1:])]
        timed = per_step[2:-1]  # after the eager steps and the capture; the last row's step ends with the samples
        res.log(f"{key}_step_ms", round(float(np.median(timed)), 1) if timed else None)
        res.log(f"{key}_losses", [round(r["loss"], 4) for r in rows])
        res.log(f"{key}_samples", bool(result.get("samples")))
    release_flame()


def release_flame():
    """Give FLAME's cached device memory back (after the caller dropped its model)."""
    import flame_core.memory as fmem
    gc.collect()
    fmem.empty_cache()


def flame_loss(model_call):
    """fwd_bwd(*inputs, target) for flame_steps: model_call(*inputs) under bf16 autocast, float32 MSE, backward."""
    import flame_core as flame
    from flame_core import amp

    def fwd_bwd(*a):
        *inputs, target = a
        with amp.autocast("cuda", dtype=flame.bfloat16):
            pred = model_call(*inputs)
        loss = ((pred.float() - target) ** 2).mean()
        loss.backward()
        return loss.detach()
    return fwd_bwd


def compile_regionally(model):
    """diffusers' regional compilation, what SimpleTuner / musubi / OneTrainer users switch on: the repeated blocks
    compiled in place (`compile_repeated_blocks(fullgraph=True)` where the model declares them: Flux, the SDXL UNet),
    else every `transformer_blocks[i].compile()` (SD3). Returns what it did."""
    if getattr(model, "_repeated_blocks", None) and hasattr(model, "compile_repeated_blocks"):
        model.compile_repeated_blocks(fullgraph=True)
        return "compile_repeated_blocks(fullgraph=True)"
    for block in model.transformer_blocks:
        block.compile()
    return "transformer_blocks[i].compile()"


def diffusers_steps(res, model, configs, make_inputs, repeats, warmup, prefix="", peers=("eager",), full=False):
    """PEFT LoRA on `model` (a frozen bf16 diffusers model; full: every weight trains instead, in float32 under bf16
    autocast, as diffusers' full fine-tuning scripts with mixed_precision bf16), then time steps for each (size, ckpt)
    and each peer of `peers`: "eager" (AdamW, as PEFT's examples) and "compiled" (regional torch.compile, fused
    AdamW: the strongest peer; its compile time is the warm-up's, reported apart and not counted in the step).
    make_inputs(size) -> (call, target): call() runs the model's forward and returns its prediction."""
    import time

    import torch
    import torch.nn.functional as F
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    if full:
        model.requires_grad_(True)
    else:
        from peft import LoraConfig
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=TARGETS))
    lora = [q for q in model.parameters() if q.requires_grad]
    for q in lora:
        q.data = q.data.float()
    res.log(f"diffusers_{prefix}params", sum(q.numel() for q in model.parameters()))
    res.log(f"diffusers_{prefix}lora_params", sum(q.numel() for q in lora))
    for peer in peers:  # eager first: compilation changes the model in place
        key = "diffusers" if peer == "eager" else "compiled"
        if peer == "compiled":
            res.log(f"compiled_{prefix}how", compile_regionally(model))
        opt = torch.optim.AdamW(lora, lr=1e-4, fused=peer == "compiled")
        done = set()
        for size, ckpt in configs:
            ckpt = peer_ckpt(ckpt)
            t = tag(size, ckpt, prefix)
            if t in done:
                continue
            done.add(t)
            if ckpt:
                model.enable_gradient_checkpointing()
            else:
                model.disable_gradient_checkpointing()
            call, target = make_inputs(size)

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = call()
                F.mse_loss(out.float(), target.float()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            try:
                t0 = time.perf_counter()
                for _ in range(max(warmup, 3 if peer == "compiled" else 0)):
                    step()
                torch.cuda.synchronize()
                if peer == "compiled":
                    res.log(f"compiled_step_{t}_warmup_s", round(time.perf_counter() - t0, 1))
                torch.cuda.reset_peak_memory_stats()
                ms = common.cuda_ms(step, repeats, warmup=0, lib="torch")[0]
                res.log(f"{key}_step_{t}_ms", round(ms, 1))
                res.log(f"{key}_step_{t}_peak_GiB", common.gib(torch.cuda.max_memory_allocated(), 3))
                res.log(f"{key}_step_{t}_peak_reserved_GiB", common.gib(torch.cuda.max_memory_reserved()))
            except torch.OutOfMemoryError:
                res.log(f"{key}_step_{t}_ms", "OOM")
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        opt = None  # rebound, not deleted: closures above use the names
    model = lora = None  # rebound, not deleted: closures above use the names
    gc.collect()
    torch.cuda.empty_cache()


def build_torch(cls, **config):
    """A diffusers model of `config`, random init (seed 0), bf16 on the GPU, frozen."""
    import torch
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(**config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.requires_grad_(False)


def report(res, configs, title, prefix="", flame_prefix=None):
    """The table: FLAME against the eager peer and the compiled one (regional torch.compile), times and peaks.
    flame_prefix: FLAME's results under their own prefix (a variant of FLAME's run, e.g. 'fp8_compute_')."""
    rows = []
    for size, ckpt in configs:
        t = tag(size, peer_ckpt(ckpt), prefix)
        ft = tag(size, ckpt, prefix if flame_prefix is None else flame_prefix)
        f, d, c = (res.get(f"{k}_step_{ft if k == 'flame' else t}_ms") for k in ("flame", "diffusers", "compiled"))
        fm, dm, cm = (res.get(f"{k}_step_{ft if k == 'flame' else t}_peak_GiB")
                      for k in ("flame", "diffusers", "compiled"))
        mode = "attn kept" if ckpt == "attn" else ("on" if ckpt else "off")
        rows.append([f"{size}x{size}", mode, f, d, c, common.ratio(f, d), common.ratio(f, c),
                     fm, dm, cm, common.ratio(fm, cm if cm is not None else dm)])
    return common.table(["size", "ckpt", "FLAME ms", "eager ms", "compiled ms", "÷ eager", "÷ compiled",
                         "FLAME GiB", "eager GiB", "compiled GiB", "peak ÷ compiled"], rows, title=title)


def configs_from(sizes, ckpt):
    """[(size, ckpt)]: --ckpt values on, off, attn (FLAME checkpoints keeping each block's attention output:
    flame_core.checkpoint's save=("attention",); the peers run their full checkpointing for it)."""
    bad = [c for c in ckpt.split(",") if c not in ("on", "off", "attn")]
    if bad:
        raise SystemExit(f"--ckpt: on, off or attn, got {bad[0]!r}")
    return [(int(s), "attn" if c == "attn" else c == "on") for s in sizes.split(",") for c in ckpt.split(",")]


def parser(doc, sizes="1024", quantize=False):
    """The options every LoRA-step bench takes (a script adds its own); `quantize`: the script builds FLAME's
    --quantize variants (quantize_blocks, variant_prefix)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--sizes", default=sizes)
    ap.add_argument("--ckpt", default="on,off")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--peer", default="eager,compiled", type=lambda v: tuple(v.split(",")),
                    help="diffusers + PEFT peers to time: eager, compiled (regional torch.compile) or both")
    ap.add_argument("--graph", action="store_true", help="FLAME: forward+backward as a CUDA graph")
    ap.add_argument("--full", action="store_true",
                    help="full fine-tuning instead of the LoRA: every weight trains, in float32 under bf16 autocast, "
                         "AdamW, on both sides")
    if quantize:
        ap.add_argument("--quantize", default=("bf16",), type=_quantize,
                        help="FLAME variants, comma-separated: bf16 (the frozen blocks as they are), fp8 (e4m3 "
                             "storage, dequantised per matmul), fp8_compute (e4m3 storage and fp8 tensor-core "
                             "matmuls), fp8_delayed (fp8_compute with delayed activation scaling); one FLAME row "
                             "per variant")
        ap.add_argument("--fp8-cache-transposes", action="store_true",
                        help="the fp8_compute / fp8_delayed variants: each weight's transpose made once and kept "
                             "resident for the input gradient (flame_nn.offload.cache_fp8_transposes_) instead of "
                             "transposed per backward call; recorded as flame_<variant>fp8_cache_transposes")
    return ap


def _quantize(v):
    got = tuple(q for q in v.split(",") if q)
    if not got or set(got) - set(QUANTIZE):
        raise argparse.ArgumentTypeError(f"one or more of {', '.join(QUANTIZE)}, got {v!r}")
    return got


def run(res, a, flame_parts, peer_parts, reports):
    """Run FLAME's parts, then the peer's (unless --skip-diffusers), print `reports` (callables returning text) and
    exit 1 when a part failed."""
    failed = common.run_parts(res, flame_parts + ([] if a.skip_diffusers else peer_parts))
    for r in reports:
        print(r(), flush=True)
    sys.exit(1 if failed else 0)


def graph_note(a):
    return "; FLAME forward+backward as a CUDA graph" if a.graph else ""
