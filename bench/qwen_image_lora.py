"""Qwen-Image LoRA training step at 1024²: FLAME side by side with diffusers + PEFT (eager and compiled) in the same
process (issue 44, scope 7).

bench/lora_step.py's protocol: the 20B MMDiT at its released size (60 dual-stream blocks, 3072 wide, 24 heads x 128,
text width 3584), random init, bf16 frozen base (≈ 41 GB); LoRA r16 a16 on to_q / to_k / to_v / to_out.0 (the image
stream's attention projections, the same names in both); fp32 adapters; AdamW lr 1e-4; bf16 autocast; batch 1; MSE
against a random target; sigma 0.62. Text: TXT_LEN Qwen2.5-VL states, every one valid, so that neither side takes a
mask (QwenImagePipeline passes none for a batch of 1); the image: 4096 tokens (img_shapes [[(1, 64, 64)]]).
The peer: diffusers 0.42.1's QwenImageTransformer2DModel + PEFT, eager, then compiled (regional torch.compile of the
repeated blocks, fused AdamW; its compile time reported apart). FLAME runs first and gives its memory back before the
peer builds its model: the two 41 GB models never share the GPU.

--run B[,B...] (GiB; default none): the whole run (cache -> train -> samples) under each max_gpu_memory, random
released-size parts (the transformer in fp8 blocks, the VAE, the Qwen2.5-VL-7B language model with the stand-in
tokenizer), 8 drawn 1024² images with captions, 20 steps, 2 CFG samples: the driver-observed peak over the run, each
stage's time and peak, the step's median time (lora_step.trainer_whole_run).
--budget B[,B...] (GiB; default none): the released size through FLAME's trainer under each max_gpu_memory with fp8
block storage (model.quantize), random weights, synthetic 1024² samples with 512-token text and its mask, the
attention LoRA, gradient checkpointing, as bench/kontext_chroma_lora.py's budget runs: whole train_step calls timed
(median, after the trainer's warm-up and CUDA-graph capture), the driver's device-memory peak (cudaMemGetInfo,
polled) over setup and steps. --only-budget runs those alone.
--blocks N: N blocks instead of 60 (a short smoke run; the bench has no CPU mode: it times CUDA events).
Run: PYTHONPATH=$PWD python3 bench/qwen_image_lora.py [--sizes 1024] [--ckpt on,off] [--repeats 5]
                                                     [--peer eager,compiled] [--graph] [--blocks N]
                                                     [--budget 24,12] [--run 24,12] [--only-budget]
"""
import dataclasses

import common
import lora_step

TXT_LEN = 512              # QwenImagePipeline's max_sequence_length; FLAME's trainer pads captions to it
SIGMA = 0.62
CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))


def _params(blocks):
    from flame_models.qwen_image import qwen_image_params
    p = qwen_image_params("qwen-image")
    return p if not blocks else dataclasses.replace(p, num_layers=blocks)


def flame_inputs(model, px, device="cuda", seed=1):
    """(fwd_bwd, args) of one step at px x px for lora_step.flame_steps: random packed latents and text states in
    bf16, the target in float32."""
    import flame_core as flame
    g = flame.Generator(device).manual_seed(seed)
    side = px // 16
    p = model.params
    img = flame.randn(1, side * side, p.in_channels, generator=g, device=device).to(flame.bfloat16)
    txt = flame.randn(1, TXT_LEN, p.joint_attention_dim, generator=g, device=device).to(flame.bfloat16)
    target = flame.randn(1, side * side, p.proj_out_dim, generator=g, device=device)
    t = flame.tensor([SIGMA], dtype=flame.bfloat16, device=device)
    shapes = [[(1, side, side)]]

    def call(img, txt):
        return model(img, txt, None, t, shapes)
    return lora_step.flame_loss(call), (img, txt, target)


def flame_part(res, configs, a, quantize="bf16"):
    model, name_map = lora_step.family_model("qwen_image", _params(a.blocks), quantize=quantize,
                                             cache_transposes=a.fp8_cache_transposes)
    lora_step.flame_steps(res, model, name_map, configs, lambda px: flame_inputs(model, px), a.repeats, a.warmup,
                          a.graph, prefix=lora_step.variant_prefix(quantize))
    model = None  # rebound, not deleted: the closure above uses the name
    lora_step.release_flame()


def diffusers_part(res, configs, a):
    import torch
    from diffusers import QwenImageTransformer2DModel
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    model = lora_step.build_torch(QwenImageTransformer2DModel, **{**CONFIG, "num_layers": a.blocks or 60})
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def make_inputs(px):
        g = torch.Generator("cuda").manual_seed(1)
        side = px // 16
        hidden = torch.randn(1, side * side, 64, generator=g, **bf16)
        txt = torch.randn(1, TXT_LEN, CONFIG["joint_attention_dim"], generator=g, **bf16)
        t = torch.full((1,), SIGMA, **bf16)
        shapes = [[(1, side, side)]]

        def call():
            return model(hidden_states=hidden, encoder_hidden_states=txt, timestep=t, img_shapes=shapes,
                         return_dict=False)[0]
        return call, torch.randn(1, side * side, 64, generator=g, device="cuda")
    lora_step.diffusers_steps(res, model, configs, make_inputs, a.repeats, a.warmup, peers=a.peer)
    model = None  # rebound, not deleted: the closure above uses the name


def budget_part(res, budget, a):
    """The released size through FLAME's trainer under max_gpu_memory `budget` GiB with fp8 block storage."""
    lora_step.trainer_budget_run(res, f"budget_{budget}GiB_fp8", "qwen_budget", "qwen_image", "qwen-image", budget,
                                 TXT_LEN, a.warmup, a.repeats)


def run_part(res, budget):
    """The whole run (cache -> train -> samples) under max_gpu_memory `budget` GiB: random released-size parts (the
    20B transformer in fp8 blocks, the VAE, the Qwen2.5-VL-7B language model with the stand-in tokenizer: see
    qwen_image.family_parts), 8 drawn 1024² images with captions, 20 steps, 2 samples with CFG (negative prompt "")."""
    lora_step.trainer_whole_run(res, f"run_{budget}GiB", "qwen_run", "qwen_image", "qwen-image", budget, neg="")


def run_report(res, budgets):
    rows = []
    for b in budgets:
        key = f"run_{b}GiB"
        f, p = res.get(f"{key}_step_ms"), res.get("compiled_step_1024_ckpt_ms")
        stages = res.get(f"{key}_stages") or []
        rows.append([f"{b} GiB", res.get(f"{key}_driver_peak_GiB"), f, p, common.ratio(f, p),
                     ", ".join(f"{st['stage']} {st['seconds']} s / {st['driver_peak_GiB']} GiB" for st in stages),
                     res.get(f"{key}_samples")])
    return common.table(["max_gpu_memory", "driver peak GiB", "step ms", "compiled peer ckpt ms", "ratio",
                         "stages (seconds / driver peak)", "samples"], rows,
                        title="\nQwen-Image whole run (cache -> 20 steps -> 2 samples at 1024², fp8 blocks, random "
                              "released-size parts)")


def budget_report(res, budgets):
    rows = []
    for b in budgets:
        key = f"budget_{b}GiB_fp8"
        f, p = res.get(f"{key}_step_ms"), res.get("compiled_step_1024_ckpt_ms")
        rows.append([f"max_gpu_memory {b} GiB, fp8", res.get(f"{key}_resident_blocks"), f,
                     res.get(f"{key}_driver_peak_GiB"), p, common.ratio(f, p)])
    return common.table(["setting", "resident blocks", "FLAME ms", "driver peak GiB", "compiled peer ckpt ms",
                         "ratio"], rows, title="\nQwen-Image through FLAME's trainer under a budget (1024², batch 1)")


def _budgets(v):
    out = []
    for x in (v or "").split(","):
        if x.strip():
            g = float(x)
            out.append(int(g) if g == int(g) else g)
    return tuple(out)


def main():
    ap = lora_step.parser(__doc__, quantize=True)
    ap.add_argument("--blocks", type=int, default=None, help="transformer blocks (default: the real 60)")
    ap.add_argument("--budget", type=_budgets, default=(), help="GiB, comma-separated: trainer runs with fp8 blocks")
    ap.add_argument("--only-budget", action="store_true", help="run the --budget / --run trainer runs alone")
    ap.add_argument("--run", type=_budgets, default=(),
                    help="GiB, comma-separated: whole runs (cache -> train -> samples) under each budget")
    a = ap.parse_args()
    if a.blocks is not None and not 1 <= a.blocks <= 60:
        ap.error(f"--blocks: 1 to 60, got {a.blocks}")
    if a.only_budget and not (a.budget or a.run):
        ap.error("--only-budget needs --budget or --run")
    for opt, vals in (("--budget", a.budget), ("--run", a.run)):
        if any(b <= 0 for b in vals):
            ap.error(f"{opt}: positive GiB, got {','.join(map(str, vals))}")
    configs = lora_step.configs_from(a.sizes, a.ckpt)
    res = common.Results("qwen_image_lora" + (f"_{a.blocks}blocks" if a.blocks else "")
                         + ("_budget" if a.only_budget else ""))
    blocks = f"{a.blocks} of 60 blocks" if a.blocks else "60 blocks, 20.4B"
    title = (f"\nQwen-Image ({blocks}) LoRA r16 (attention) training step, bf16 autocast, batch 1, {TXT_LEN} text "
             f"tokens (median ms; peak allocated GiB)" + lora_step.graph_note(a))
    ours = [] if a.only_budget else [(f"FLAME {q}", lambda q=q: flame_part(res, configs, a, q)) for q in a.quantize]
    ours += [(f"FLAME trainer, {b} GiB, fp8", lambda b=b: budget_part(res, b, a)) for b in a.budget]
    ours += [(f"FLAME whole run, {b} GiB, fp8", lambda b=b: run_part(res, b)) for b in a.run]
    reports = [] if a.only_budget else [
        lambda q=q: lora_step.report(res, configs, title + lora_step.variant_note(q, a.fp8_cache_transposes),
                                     flame_prefix=lora_step.variant_prefix(q)) for q in a.quantize]
    if a.budget:
        reports.append(lambda: budget_report(res, a.budget))
    if a.run:
        reports.append(lambda: run_report(res, a.run))
    peers = [] if a.only_budget else [("diffusers+PEFT", lambda: diffusers_part(res, configs, a))]
    lora_step.run(res, a, ours, peers, reports)


if __name__ == "__main__":
    main()
