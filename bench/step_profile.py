"""Where a LoRA training step spends its GPU time: FLAME's graphed step and the compiled diffusers + PEFT peer's,
kernel by kernel, grouped the same way for both.

Both sides are traced by CUPTI through torch.profiler in the same process (it records every kernel of the process,
CuPy's and the ones a CUDA graph replays included). FLAME is traced twice: the LoRA step (forward + backward replayed
as one CUDA graph, then AdamW), and the same forward + backward with the input requiring a gradient instead of any
adapter (every activation gradient, no LoRA): the difference is what the adapters cost. Groups: GEMM, attention,
norm + modulation + elementwise, casts / copies / layout, optimizer, other. Protocol otherwise bench/lora_step.py's
(1024², LoRA r16 on to_q / to_k / to_v / to_out.0, bf16 autocast, batch 1, random weights).

--quantize fp8_compute: FLAME's frozen blocks in fp8 with fp8 tensor-core matmuls (bench/lora_step.py's variants;
the peer stays bf16); the activations' fp8 quantisation and the weights' byte transposes are their own group.
The JSON keeps every kernel of at least 0.05 ms a step by group (flame_kernels, flame_nolora_kernels,
compiled_kernels), not only the top; the report lists the kernels whose time the adapters add (the LoRA step's
minus the step without them, kernel by kernel), and the SM clock and board power while each side steps (nvidia-smi
sampled every 20 ms over a second of steps, outside the trace): a clock that drops where the step is denser in
power slows the compute-bound kernels of that side alone.
Run: PYTHONPATH=$PWD python3 bench/step_profile.py [--model flux|sd35l] [--ckpt off|on] [--steps 2]
                                                   [--quantize bf16|fp8|fp8_compute]
"""
import argparse
import collections
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
import traceback

import common
import lora_step

GROUPS = ["GEMM", "attention", "norm + modulation + elementwise", "fp8 quantise / transpose", "casts / copies / layout",
          "optimizer", "other"]


def group(name):
    """The group of a kernel from its name (cuBLAS / cuBLASLt, FLAME's NVRTC kernels, CuPy's elementwise kernels,
    torch's and Triton's)."""
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attn", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "gemv", "cublas", "splitk")):
        return "GEMM"
    if "adam" in n:
        return "optimizer"
    if "fp8" in n or "e4m3" in n:
        return "fp8 quantise / transpose"
    if any(s in n for s in ("copy", "memcpy", "memset", "cast", "convert", "transpose", "cat_", "concat",
                            "fill", "contiguous", "gather", "scatter")):
        return "casts / copies / layout"
    if any(s in n for s in ("norm", "modulate", "gated", "gelu", "silu", "rope", "softmax", "pws_", "column_sum",
                            "triton", "elementwise", "reduce", "cupy_", "mul", "add", "sum", "mean", "pow")):
        return "norm + modulation + elementwise"
    return "other"


def parse_clock_samples(text):
    """[(SM MHz, board W)] of nvidia-smi's `--query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits` lines
    (lines that do not parse -- "[N/A]", a cut last line -- are left out)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            out.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return out


def clocks_while(step, seconds=1.0, lib="cupy"):
    """(median SM MHz, median W) of the current GPU while step() runs back to back for about `seconds` (nvidia-smi
    sampling every 20 ms in a child process; `lib` the step's array library, synchronised after each step), or
    (None, None) where nvidia-smi is missing or gives nothing."""
    import cupy
    dev = str(cupy.cuda.runtime.getDevice())
    try:
        proc = subprocess.Popen(["nvidia-smi", "-i", dev, "--query-gpu=clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None, None
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            common.synchronize(lib)
    finally:
        proc.terminate()
        text = proc.communicate(timeout=10)[0]
    samples = parse_clock_samples(text)
    if not samples:
        return None, None
    return statistics.median(m for m, _ in samples), statistics.median(w for _, w in samples)


def trace(step, steps):
    """(kernel ms per step by group, top kernels, kernels per step, every kernel >= 0.05 ms a step by group) of
    `steps` calls of step(), from a CUPTI trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        common.synchronize()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    by_group, by_kernel = collections.Counter(), collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0) / 1e3 / steps
        name = e.get("name", "")
        by_group[group(name) if e["cat"] == "kernel" else "casts / copies / layout"] += ms
        by_kernel[name[:90]] += ms
        count[name[:90]] += 1
    top = [(k, round(v, 2), count[k] // steps) for k, v in by_kernel.most_common(12)]
    # every kernel of at least 0.05 ms a step, by group (the JSON keeps them: what a group is made of)
    full = {g: [] for g in GROUPS}
    for k, v in by_kernel.most_common():
        if v >= 0.05:
            full[group(k)].append((k, round(v, 2), count[k] // steps))
    return {g: round(by_group.get(g, 0.0), 1) for g in GROUPS}, top, sum(count.values()) // steps, full


def nolora(res, a, base, args):
    import flame_core as flame
    def with_input_grad(x, *rest):   # the graph's static copy of x is a plain tensor: ask for its gradient inside
        return base(x.detach().requires_grad_(True), *rest)
    run = flame.cuda.graphed(with_input_grad, warmup=2)
    for _ in range(4):
        run(*args)
    common.synchronize()
    if run.graph is None:  # never profile eager steps as the graph's
        raise RuntimeError("the step was not captured: flame.cuda.graphed ran it eagerly")
    res.log("flame_nolora_ms", round(common.cuda_ms(lambda: run(*args), 3, warmup=0)[0], 1))
    res.log("flame_nolora_clock_mhz_w", clocks_while(lambda: run(*args)))
    groups, _, n, full = trace(lambda: run(*args), a.steps)
    res.log("flame_nolora_groups", groups)
    res.log("flame_nolora_kernels_per_step", n)
    res.log("flame_nolora_kernels", full)
    run.reset()


def flame_part(res, a):
    import flame_core as flame
    import flame_nn
    from flame_nn import adapters as A
    if a.model == "flux":
        from flame_models.flux.lora_keys import name_map_for
        from flame_models.flux.params import configs as presets
        model = common.random_flux(presets["flux-dev"])
        # a frozen base (family_model's is too): without adapters only the input's gradient flows, and fp8
        # quantises frozen weights only
        model.requires_grad_(False)
        lora_step.quantize_blocks((model.double_blocks, model.single_blocks), a.quantize, a.fp8_cache_transposes)
        name_map = name_map_for(presets["flux-dev"])
        kw, target = common.flame_flux_inputs(a.size, guidance=1.0)
        base = common.flame_flux_loss_step(model, kw)
        args = [kw["img"], kw["txt"], kw["y"], target]
    else:
        model, name_map = lora_step.family_model("sd3", "sd3.5-large", quantize=a.quantize,
                                                  cache_transposes=a.fp8_cache_transposes)
        g = flame.Generator("cuda").manual_seed(1)
        lat = a.size // 8
        x = flame.randn(1, 16, lat, lat, generator=g, device="cuda").to(flame.bfloat16)
        ctx = flame.randn(1, 333, 4096, generator=g, device="cuda").to(flame.bfloat16)
        y = flame.randn(1, 2048, generator=g, device="cuda").to(flame.bfloat16)
        t = flame.tensor([500.0], device="cuda")
        base = lora_step.flame_loss(model)
        args = [x, t, y, ctx, flame.randn(1, 16, lat, lat, generator=g, device="cuda")]
    model.enable_gradient_checkpointing(a.ckpt == "on")

    # the same forward + backward without adapters: the input carries the gradient through every block
    try:
        nolora(res, a, base, args)
    except Exception:  # noqa: BLE001 (a failure here leaves the LoRA step's profile to run)
        traceback.print_exc()
    args[0] = args[0].detach()
    gc.collect()

    A.inject_adapters(model, lora_step.TARGETS, "lora", rank=16, alpha=16, name_map=name_map,
                      generator=flame.Generator("cuda").manual_seed(1))
    opt = flame_nn.optim.AdamW(A.adapter_parameters(model), lr=1e-4)
    model.train()
    run = flame.cuda.graphed(base, warmup=2)

    def step():
        run(*args)
        opt.step()
        opt.zero_grad(set_to_none=False)
    for _ in range(4):
        step()
    common.synchronize()
    if run.graph is None:
        raise RuntimeError("the step was not captured: flame.cuda.graphed ran it eagerly")
    res.log("flame_step_ms", round(common.cuda_ms(step, 3, warmup=0)[0], 1))
    res.log("flame_clock_mhz_w", clocks_while(step))
    groups, top, n, full = trace(step, a.steps)
    res.log("flame_groups", groups)
    res.log("flame_kernels_per_step", n)
    res.log("flame_top", top)
    res.log("flame_kernels", full)
    run.reset()


def peer_part(res, a):
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig
    if a.model == "flux":
        model = common.diffusers_flux()
        kw = common.diffusers_inputs(a.size, guidance=1.0)
        target = torch.randn_like(kw["hidden_states"])
    else:
        import sd3_lora
        from diffusers import SD3Transformer2DModel
        model = lora_step.build_torch(SD3Transformer2DModel, **sd3_lora.diffusers_config("large"))
        b = dict(device="cuda", dtype=torch.bfloat16)
        lat = a.size // 8
        kw = dict(hidden_states=torch.randn(1, 16, lat, lat, **b), encoder_hidden_states=torch.randn(1, 333, 4096, **b),
                  pooled_projections=torch.randn(1, 2048, **b), timestep=torch.tensor([500.0], device="cuda"),
                  return_dict=False)
        target = torch.randn_like(kw["hidden_states"])
    torch.backends.cuda.enable_cudnn_sdp(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=lora_step.TARGETS))
    lora = [q for q in model.parameters() if q.requires_grad]
    for q in lora:
        q.data = q.data.float()
    opt = torch.optim.AdamW(lora, lr=1e-4, fused=True)
    res.log("compiled_how", lora_step.compile_regionally(model))
    if a.ckpt == "on":
        model.enable_gradient_checkpointing()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**kw)[0]
        F.mse_loss(out.float(), target.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    res.log("compiled_step_ms", round(common.cuda_ms(step, 3, warmup=0, lib="torch")[0], 1))
    res.log("compiled_clock_mhz_w", clocks_while(step, lib="torch"))
    groups, top, n, full = trace(step, a.steps)
    res.log("compiled_groups", groups)
    res.log("compiled_kernels_per_step", n)
    res.log("compiled_top", top)
    res.log("compiled_kernels", full)


def adapters_add(lora, nolora, top=15):
    """[(kernel, ms per step with the adapters, without, calls with, without)] of the `top` kernels whose time the
    adapters change most (either way), from two `trace` kernel lists by group."""
    def flat(full):
        return {k: (ms, n) for g in (full or {}).values() for k, ms, n in g}
    w, wo = flat(lora), flat(nolora)
    rows = [(k, w.get(k, (0.0, 0))[0], wo.get(k, (0.0, 0))[0], w.get(k, (0.0, 0))[1], wo.get(k, (0.0, 0))[1])
            for k in set(w) | set(wo)]
    rows.sort(key=lambda r: -abs(r[1] - r[2]))
    return rows[:top]


def report(res, a):
    f, c, b = res.get("flame_groups") or {}, res.get("compiled_groups") or {}, res.get("flame_nolora_groups") or {}
    rows = []
    for g in GROUPS:
        rows.append([g, f.get(g), b.get(g), c.get(g), common.ratio(f.get(g), c.get(g))])
    tot = [sum(d.values()) if d else None for d in (f, b, c)]
    rows.append(["kernel total", *[round(t, 1) if t is not None else None for t in tot], common.ratio(tot[0], tot[2])])
    out = [a for g, a in zip(GROUPS, f.values()) if g != "attention"]
    pc = [v for g, v in c.items() if g != "attention"]
    rows.append(["outside attention", round(sum(out), 1) if out else None, None, round(sum(pc), 1) if pc else None,
                 common.ratio(sum(out) if out else None, sum(pc) if pc else None)])
    step, peer = res.get("flame_step_ms"), res.get("compiled_step_ms")
    rows.append(["step (CUDA events)", step, res.get("flame_nolora_ms"), peer, common.ratio(step, peer)])
    rows.append(["kernels per step", res.get("flame_kernels_per_step"), res.get("flame_nolora_kernels_per_step"),
                 res.get("compiled_kernels_per_step"), "-"])
    clk = [res.get(k) or (None, None)
           for k in ("flame_clock_mhz_w", "flame_nolora_clock_mhz_w", "compiled_clock_mhz_w")]
    rows.append(["SM clock MHz (median, stepping)", *[c[0] for c in clk], common.ratio(clk[0][0], clk[2][0])])
    rows.append(["board power W (median, stepping)", *[c[1] for c in clk], common.ratio(clk[0][1], clk[2][1])])
    return common.table(["group (ms per step)", "FLAME LoRA step", "FLAME no adapters", "compiled peer",
                         "FLAME ÷ peer"], rows,
                        title=f"\n{a.model} {a.size}² LoRA step, checkpointing {a.ckpt}"
                              + ("" if a.quantize == "bf16" else f", FLAME {a.quantize}")
                              + ": GPU kernel time by group")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="flux", choices=["flux", "sd35l"])
    ap.add_argument("--ckpt", default="off", choices=["off", "on"])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--quantize", default="bf16", choices=lora_step.QUANTIZE)
    ap.add_argument("--fp8-cache-transposes", action="store_true",
                    help="fp8_compute / fp8_delayed: every weight's W^T made once and kept (as bench/*_lora.py's flag)")
    a = ap.parse_args()
    res = common.Results(f"step_profile_{a.model}_{a.ckpt}" + ("" if a.quantize == "bf16" else f"_{a.quantize}"))
    parts = [("FLAME", lambda: (flame_part(res, a), lora_step.release_flame()))]  # its model freed on return
    if not a.skip_diffusers:
        parts.append(("compiled peer", lambda: peer_part(res, a)))
    failed = common.run_parts(res, parts)
    for k in ("flame_top", "compiled_top"):
        print(f"\n{k}:")
        for name, ms, n in res.get(k) or []:
            print(f"  {ms:8.2f} ms {n:5d}x  {name}")
    if res.get("flame_nolora_kernels"):
        print("\nwhat the adapters change (ms per step with / without; calls with / without):")
        for name, w, wo, n, no in adapters_add(res.get("flame_kernels"), res.get("flame_nolora_kernels")):
            print(f"  {w - wo:+8.2f} ms  {w:7.2f} / {wo:7.2f}  {n:5d} / {no:5d}x  {name}")
    print(report(res, a), flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
