"""Flux-dev-size LoRA training step: FLAME side by side with diffusers + PEFT in the same process.

11.9B-parameter Flux-dev, random init, bf16 frozen base; LoRA r=16 alpha=16 on the attention projections (diffusers
names to_q / to_k / to_v / to_out.0; in FLAME the same rows of BFL's fused qkv and the proj Linears); fp32 adapter
parameters; AdamW lr 1e-4; bf16 autocast; batch 1; T5 length 512; guidance 1.0; MSE against a random target.
Sizes 512x512 (1024 image tokens) and 1024x1024 (4096), gradient checkpointing on and off.

Timing: CUDA events around whole steps (forward, backward, optimizer step, zero_grad) after warm-up, median of
repeats. Peak: the framework's max allocated bytes over the timed steps (weights included); with --graph FLAME's over
the capture step (a replay allocates nothing: its buffers are allocated and freed once, at capture, as in an eager
step). Max reserved bytes (FLAME's pool / torch's caching allocator) beside them. FLAME runs first and releases its
memory before diffusers builds its model.
Run: PYTHONPATH=$PWD python3 bench/flux_lora.py [--sizes 512,1024] [--ckpt on,off] [--repeats 5] [--graph]
"""
import argparse
import gc
import sys

import numpy as np

import common

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def flame_part(res, configs, repeats, warmup, blocks=None, graph=False):
    import flame_core as flame
    import flame_core.memory as fmem
    import flame_nn
    from flame_nn import adapters as A
    from flame_models.flux.lora_keys import name_map_for
    from flame_models.flux.params import configs as presets
    p = presets["flux-dev"] if not blocks else presets["flux-dev"].replace(depth=blocks[0],
                                                                            depth_single_blocks=blocks[1])
    model = common.random_flux(p)
    made = A.inject_adapters(model, TARGETS, "lora", rank=16, alpha=16, name_map=name_map_for(p),
                             generator=flame.Generator("cuda").manual_seed(1))
    lora = A.adapter_parameters(model)
    model.train()
    opt = flame_nn.optim.AdamW(lora, lr=1e-4)
    res.log("flame_params", sum(q.numel() for q in model.parameters()))
    res.log("flame_lora_params", sum(q.numel() for q in lora))
    res.log("flame_adapted_layers", len(made))
    for size, ckpt in configs:
        tag = f"{size}_{'ckpt' if ckpt else 'nockpt'}"
        model.enable_gradient_checkpointing(ckpt)
        kw, target = common.flame_flux_inputs(size, guidance=1.0)
        losses = []
        # --graph: forward + backward captured as a CUDA graph after 2 eager steps; AdamW runs eagerly on the
        # gradients the replay accumulated (one fused launch)
        run = flame.cuda.graphed(common.flame_flux_loss_step(model, kw), warmup=2, enabled=graph)

        def step():
            loss = run(kw["img"], kw["txt"], kw["y"], target)
            opt.step()
            opt.zero_grad(set_to_none=not graph)
            losses.append(loss.clone() if graph else loss)
        try:
            for _ in range(max(warmup, 2)):
                step()
            common.synchronize()
            fmem.reset_peak_memory_stats()
            if graph:  # the capture step: every buffer of the graph is allocated (and freed) once
                step()
                common.synchronize()
                capture_peak = fmem.max_memory_allocated()
                res.log(f"flame_step_{tag}_capture_peak_allocated_GiB", common.gib(capture_peak))
                fmem.reset_peak_memory_stats()
            ms = common.cuda_ms(step, repeats, warmup=0)[0]
            lv = [float(v.item()) for v in losses]
            assert all(np.isfinite(lv)), f"non-finite loss {lv}"
            res.log(f"flame_step_{tag}_ms", round(ms, 1))
            res.log(f"flame_step_{tag}_peak_GiB", common.gib(capture_peak if graph else fmem.max_memory_allocated()))
            res.log(f"flame_step_{tag}_peak_reserved_GiB", common.gib(fmem.max_memory_reserved()))
            res.log(f"flame_step_{tag}_loss_first_last", (round(lv[0], 4), round(lv[-1], 4)))
        except flame.OutOfMemoryError as ex:
            res.log(f"flame_step_{tag}_ms", f"OOM: {str(ex).splitlines()[0]}")
        run.reset()
        del kw, target, losses, run, step
        opt.zero_grad()
        gc.collect()
    del model, opt, lora
    gc.collect()
    fmem.empty_cache()


def diffusers_part(res, configs, repeats, warmup, blocks=None):
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig
    model = common.diffusers_flux(blocks)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=TARGETS))
    lora = [q for q in model.parameters() if q.requires_grad]
    for q in lora:
        q.data = q.data.float()
    res.log("diffusers_lora_params", sum(q.numel() for q in lora))
    opt = torch.optim.AdamW(lora, lr=1e-4)
    for size, ckpt in configs:
        tag = f"{size}_{'ckpt' if ckpt else 'nockpt'}"
        if ckpt:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        kw = common.diffusers_inputs(size, guidance=1.0)
        target = torch.randn_like(kw["hidden_states"])

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**kw)[0]
            F.mse_loss(out.float(), target.float()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        try:
            for _ in range(warmup):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = common.cuda_ms(step, repeats, warmup=0, lib="torch")[0]
            res.log(f"diffusers_step_{tag}_ms", round(ms, 1))
            res.log(f"diffusers_step_{tag}_peak_GiB", common.gib(torch.cuda.max_memory_allocated()))
            res.log(f"diffusers_step_{tag}_peak_reserved_GiB", common.gib(torch.cuda.max_memory_reserved()))
        except torch.OutOfMemoryError:
            res.log(f"diffusers_step_{tag}_ms", "OOM")
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()


def report(res, configs, graph):
    rows = []
    for size, ckpt in configs:
        tag = f"{size}_{'ckpt' if ckpt else 'nockpt'}"
        f, d = res.get(f"flame_step_{tag}_ms"), res.get(f"diffusers_step_{tag}_ms")
        fm, dm = res.get(f"flame_step_{tag}_peak_GiB"), res.get(f"diffusers_step_{tag}_peak_GiB")
        fr, dr = res.get(f"flame_step_{tag}_peak_reserved_GiB"), res.get(f"diffusers_step_{tag}_peak_reserved_GiB")
        rows.append([f"{size}x{size}", "on" if ckpt else "off", f, d, common.ratio(f, d), fm, dm,
                     common.ratio(fm, dm), f"{fr} / {dr}"])
    return common.table(["size", "ckpt", "FLAME ms", "diffusers ms", "ratio", "FLAME GiB", "diffusers GiB", "ratio",
                         "reserved GiB"], rows,
                        title="\nFlux-dev LoRA r16 (attention) training step, bf16 autocast, batch 1, T5 512 (median "
                              "ms; peak allocated GiB)" + ("; FLAME forward+backward as a CUDA graph" if graph else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--ckpt", default="on,off")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--blocks", default=None, help="double,single block counts (default: flux-dev's 19,38)")
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--graph", action="store_true", help="FLAME: forward+backward as a CUDA graph")
    a = ap.parse_args()
    configs = [(int(s), c == "on") for s in a.sizes.split(",") for c in a.ckpt.split(",")]
    blocks = tuple(int(v) for v in a.blocks.split(",")) if a.blocks else None
    res = common.Results("flux_lora")
    parts = [("FLAME", lambda: flame_part(res, configs, a.repeats, a.warmup, blocks, a.graph))]
    if not a.skip_diffusers:
        parts.append(("diffusers+PEFT", lambda: diffusers_part(res, configs, a.repeats, a.warmup, blocks)))
    failed = common.run_parts(res, parts)
    print(report(res, configs, a.graph), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
