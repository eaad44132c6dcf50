"""Flux-dev-size LoRA training step: FLAME side by side with diffusers + PEFT in the same process (the PEERS.md setup).

11.9B-parameter Flux-dev, random init, bf16 frozen base; LoRA r=16 alpha=16 on the attention projections (diffusers
names to_q / to_k / to_v / to_out.0; in FLAME the same rows of BFL's fused qkv and the proj Linears); fp32 adapter
parameters; AdamW lr 1e-4; bf16 autocast; batch 1; T5 length 512; guidance 1.0; MSE against a random target.
Sizes 512x512 (1024 image tokens) and 1024x1024 (4096), gradient checkpointing on and off.

Timing: CUDA events around whole steps (forward, backward, optimizer step, zero_grad) after warm-up, median of
repeats. Peak: the framework's max allocated bytes (live tensors, weights included) over the timed steps, reset before
them; with --graph FLAME's over the capture step (a replayed graph allocates nothing: its buffers are allocated and
freed once, at capture, in the same order as an eager step). Max reserved bytes (what the pool / torch's caching
allocator holds from the device) are reported beside them.
FLAME runs first and releases its memory before diffusers builds its model.
Run on the device (diffusers and peft as carried wheels):
    PYTHONPATH=$PWD python3 bench/flux_lora.py [--sizes 512,1024] [--ckpt on,off] [--repeats 5]
Writes $OUT/flux_lora.json and prints a table last.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

T5_LEN = 512
GRAPH = False     # --graph: FLAME's forward + backward replayed as a CUDA graph
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
R = {}


def log(key, value):
    R[key] = value
    print(f"{key}: {value}", flush=True)


def gib(n):
    return round(n / 2 ** 30, 2)


def flame_part(configs, repeats, warmup, blocks=None):
    import cupy as cp
    import flame_core as flame
    import flame_core.memory as fmem
    import flame_nn
    from flame_core import amp
    from flame_nn import adapters as A
    from flame_models.flux import sampling as S
    from flame_models.flux.lora_keys import name_map_for
    from flame_models.flux.params import configs as presets

    p = presets["flux-dev"]
    if blocks:
        p = p.replace(depth=blocks[0], depth_single_blocks=blocks[1])
    t0 = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flux_random import random_flux
    model = random_flux(p)  # N(0, 0.02) weights drawn on the GPU; QK-norm scales 1
    g = flame.Generator("cuda").manual_seed(0)
    model.requires_grad_(False)
    made = A.inject_adapters(model, TARGETS, "lora", rank=16, alpha=16, name_map=name_map_for(p),
                             generator=flame.Generator("cuda").manual_seed(1))
    lora = A.adapter_parameters(model)
    model.train()
    opt = flame_nn.optim.AdamW(lora, lr=1e-4)
    cp.cuda.Device().synchronize()
    log("flame_build_s", round(time.perf_counter() - t0, 1))
    log("flame_params", sum(q.numel() for q in model.parameters()))
    log("flame_lora_params", sum(q.numel() for q in lora))
    log("flame_adapted_layers", len(made))

    for size, ckpt in configs:
        tag = f"{size}_{'ckpt' if ckpt else 'nockpt'}"
        model.enable_gradient_checkpointing(ckpt)
        tokens = (size // 16) ** 2

        def rnd(*shape):
            return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
        kw = dict(img=rnd(1, tokens, 64), img_ids=S.image_ids(size, size, device="cuda"), txt=rnd(1, T5_LEN, 4096),
                  txt_ids=S.text_ids(T5_LEN, device="cuda"), y=rnd(1, 768),
                  timesteps=flame.tensor([0.62], device="cuda"), guidance=flame.tensor([1.0], device="cuda"))
        target = rnd(1, tokens, 64).float()
        losses = []

        def fwd_bwd(img, txt, y, target):
            with amp.autocast("cuda", dtype=flame.bfloat16):
                pred = model(**dict(kw, img=img, txt=txt, y=y))
            loss = ((pred.float() - target) ** 2).mean()
            loss.backward()
            return loss.detach()
        # --graph: forward + backward captured as a CUDA graph after 2 eager steps (flame_core.cuda.graphed); the
        # optimizer runs eagerly on the gradients the replay accumulated (one fused launch)
        run = flame.cuda.graphed(fwd_bwd, warmup=2, enabled=GRAPH)

        def step():
            loss = run(kw["img"], kw["txt"], kw["y"], target)
            opt.step()
            opt.zero_grad(set_to_none=not GRAPH)
            losses.append(loss.clone() if GRAPH else loss)
        try:
            for _ in range(max(warmup, 2)):
                step()
            cp.cuda.Device().synchronize()
            fmem.reset_peak_memory_stats()
            if GRAPH:  # the capture step: every buffer of the graph is allocated (and freed) once, as in eager mode
                step()
                cp.cuda.Device().synchronize()
                log(f"flame_step_{tag}_capture_peak_allocated_GiB", round(fmem.max_memory_allocated() / 2 ** 30, 2))
                fmem.reset_peak_memory_stats()
            ms = []
            for _ in range(repeats):
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                step()
                e.record()
                e.synchronize()
                ms.append(cp.cuda.get_elapsed_time(s, e))
            lv = [float(v.item()) for v in losses]
            assert all(np.isfinite(lv)), f"non-finite loss {lv}"
            log(f"flame_step_{tag}_ms", round(statistics.median(ms), 1))
            # peak allocated = live bytes at the step's high point, as torch's figure; a replayed graph allocates
            # nothing (its buffers were allocated and freed at capture), so in --graph mode it is the capture step's
            peak = R[f"flame_step_{tag}_capture_peak_allocated_GiB"] * 2 ** 30 if GRAPH else fmem.max_memory_allocated()
            log(f"flame_step_{tag}_peak_GiB", round(peak / 2 ** 30, 2))
            log(f"flame_step_{tag}_peak_reserved_GiB", round(fmem.max_memory_reserved() / 2 ** 30, 2))
            log(f"flame_step_{tag}_loss_first_last", (round(lv[0], 4), round(lv[-1], 4)))
        except flame.OutOfMemoryError as ex:
            log(f"flame_step_{tag}_ms", f"OOM: {str(ex).splitlines()[0]}")
        run.reset()
        del kw, target, losses, run, step
        opt.zero_grad()
        gc.collect()
    del model, opt, lora
    gc.collect()
    fmem.empty_cache()


def diffusers_part(configs, repeats, warmup, blocks=None):
    import torch
    import torch.nn.functional as F
    import diffusers
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig
    log("diffusers_version", diffusers.__version__)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as shared/peers/flux_peer.py (cuDNN SDPA crashes in backward here)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    nd, ns = blocks or (19, 38)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=nd, num_single_layers=ns,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                       pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=TARGETS))
    lora = [q for q in model.parameters() if q.requires_grad]
    for q in lora:
        q.data = q.data.float()
    log("diffusers_lora_params", sum(q.numel() for q in lora))
    opt = torch.optim.AdamW(lora, lr=1e-4)
    for size, ckpt in configs:
        tag = f"{size}_{'ckpt' if ckpt else 'nockpt'}"
        if ckpt:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        tokens, side = (size // 16) ** 2, size // 16
        hs = torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16)
        ehs = torch.randn(1, T5_LEN, 4096, device="cuda", dtype=torch.bfloat16)
        pooled = torch.randn(1, 768, device="cuda", dtype=torch.bfloat16)
        t = torch.full((1,), 0.62, device="cuda", dtype=torch.bfloat16)
        img_ids = torch.zeros(side, side, 3, device="cuda")
        img_ids[..., 1] = torch.arange(side, device="cuda")[:, None]
        img_ids[..., 2] = torch.arange(side, device="cuda")[None, :]
        img_ids = img_ids.reshape(-1, 3)
        txt_ids = torch.zeros(T5_LEN, 3, device="cuda")
        guid = torch.full((1,), 1.0, device="cuda", dtype=torch.bfloat16)
        target = torch.randn_like(hs)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(hidden_states=hs, encoder_hidden_states=ehs, pooled_projections=pooled, timestep=t,
                            img_ids=img_ids, txt_ids=txt_ids, guidance=guid, return_dict=False)[0]
            loss = F.mse_loss(out.float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        try:
            for _ in range(warmup):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = []
            for _ in range(repeats):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                step()
                e.record()
                e.synchronize()
                ms.append(s.elapsed_time(e))
            log(f"diffusers_step_{tag}_ms", round(statistics.median(ms), 1))
            log(f"diffusers_step_{tag}_peak_GiB", round(torch.cuda.max_memory_allocated() / 2 ** 30, 2))
            log(f"diffusers_step_{tag}_peak_reserved_GiB", round(torch.cuda.max_memory_reserved() / 2 ** 30, 2))
        except torch.OutOfMemoryError:
            log(f"diffusers_step_{tag}_ms", "OOM")
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()


def table(configs):
    lines = ["", "Flux-dev LoRA r16 (attention) training step, bf16 autocast, batch 1, T5 512 (median ms; peak GiB)"
             + ("; FLAME forward+backward as a CUDA graph" if GRAPH else ""),
             f"{'size':>9} {'ckpt':>5} | {'FLAME ms':>9} {'diffusers':>10} {'ratio':>6} | {'FLAME GiB':>9} "
             f"{'diffusers':>10} {'ratio':>6}"]
    for size, ckpt in configs:
        tag = f"{size}_{'ckpt' if ckpt else 'nockpt'}"
        f, d = R.get(f"flame_step_{tag}_ms"), R.get(f"diffusers_step_{tag}_ms")
        fm, dm = R.get(f"flame_step_{tag}_peak_GiB"), R.get(f"diffusers_step_{tag}_peak_GiB")
        num = isinstance(f, float) and isinstance(d, float)
        r = f"{f / d:.3f}" if num else "-"
        rm = f"{fm / dm:.3f}" if fm and dm else "-"
        lines.append(f"{f'{size}x{size}':>9} {'on' if ckpt else 'off':>5} | {str(f):>9} {str(d):>10} {r:>6} | "
                     f"{str(fm):>9} {str(dm):>10} {rm:>6}")
        fr, dr = R.get(f"flame_step_{tag}_peak_reserved_GiB"), R.get(f"diffusers_step_{tag}_peak_reserved_GiB")
        if fr or dr:
            lines.append(f"{'':>15} peak reserved (pool / caching allocator): FLAME {fr} GiB, diffusers {dr} GiB")
    return "\n".join(lines)


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
    global GRAPH
    GRAPH = a.graph
    configs = [(int(s), c == "on") for s in a.sizes.split(",") for c in a.ckpt.split(",")]
    blocks = tuple(int(v) for v in a.blocks.split(",")) if a.blocks else None
    out = os.path.join(os.environ.get("OUT", "."), "flux_lora.json")
    failed = False
    for name, part in (("FLAME", flame_part), ("diffusers+PEFT", diffusers_part)):
        if name != "FLAME" and a.skip_diffusers:
            continue
        print(f"\n== {name} ({time.strftime('%X')})", flush=True)
        try:
            part(configs, a.repeats, a.warmup, blocks)
        except Exception:
            traceback.print_exc()
            failed = True
        json.dump(R, open(out, "w"), indent=1, default=str)
    print(table(configs), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
