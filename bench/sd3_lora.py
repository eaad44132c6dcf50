"""SD3.5 LoRA training step at 1024²: FLAME side by side with diffusers + PEFT in the same process (issue 28).

SD3.5 Large (8.07B, 38 joint blocks) and Medium (2.25B, MMDiT-X: dual attention in blocks 0-12), bench/lora_step.py's
protocol (random bf16 base, LoRA r16 on to_q/to_k/to_v/to_out.0 -- attn2's too in Medium, as PEFT's suffix match --
fp32 adapters, AdamW, bf16 autocast, batch 1), latents 16x128x128, context 77 CLIP + 256 T5 tokens, t = 500,
gradient checkpointing on and off.

--budget B (default 10): SD3.5 Large trained by FLAME's trainer under max_gpu_memory B GiB with fp8 block storage
(model.quantize): random weights drawn block by block, the blocks streamed from pinned host memory as auto_fit
chooses, gradient checkpointing, CUDA-graph steps, synthetic 1024² latents and 333-token text. Timed: whole
train_step calls (median, after the trainer's own warm-up), the driver's device-memory peak (cudaMemGetInfo, polled)
over setup and steps. Compared with the peer's checkpointing step (acceptance: peak <= B, step <= 1.3x).
--quantize bf16,fp8,fp8_compute: FLAME's frozen blocks as they are, in fp8 storage, or in fp8 with fp8 compute; one
FLAME row per variant (bench/lora_step.py).
Run: PYTHONPATH=$PWD python3 bench/sd3_lora.py [--models large,medium] [--ckpt on,off] [--repeats 5] [--graph]
                                                [--budget 10] [--skip-diffusers] [--quantize bf16,fp8_compute]
"""

import common
import lora_step

CTX = 77 + 256
SIZES = {"large": "sd3.5-large", "medium": "sd3.5-medium"}


def flame_part(res, which, configs, a, quantize="bf16"):
    import flame_core as flame
    model, name_map = lora_step.family_model("sd3", SIZES[which], quantize=quantize,
                                             cache_transposes=a.fp8_cache_transposes)
    bf16 = dict(dtype=flame.bfloat16)

    def make_step(px):
        g = flame.Generator("cuda").manual_seed(1)
        side = px // 8
        x = flame.randn(1, 16, side, side, generator=g, device="cuda").to(**bf16)
        ctx = flame.randn(1, CTX, 4096, generator=g, device="cuda").to(**bf16)
        y = flame.randn(1, 2048, generator=g, device="cuda").to(**bf16)
        t = flame.tensor([500.0], device="cuda")
        target = flame.randn(1, 16, side, side, generator=g, device="cuda")
        return lora_step.flame_loss(model), (x, t, y, ctx, target)
    lora_step.flame_steps(res, model, name_map, configs, make_step, a.repeats, a.warmup, a.graph,
                          prefix=f"{which}_{lora_step.variant_prefix(quantize)}")
    model = None  # rebound, not deleted: closures above use the name
    lora_step.release_flame()


def diffusers_config(which):
    if which == "large":
        cfg = dict(num_layers=38, num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192)
    else:
        cfg = dict(num_layers=24, num_attention_heads=24, caption_projection_dim=1536, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)))
    return dict(cfg, sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
                joint_attention_dim=4096, pooled_projection_dim=2048, qk_norm="rms_norm")


def diffusers_part(res, which, configs, a):
    import torch
    from diffusers import SD3Transformer2DModel
    model = lora_step.build_torch(SD3Transformer2DModel, **diffusers_config(which))
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def make_inputs(px):
        side = px // 8
        x = torch.randn(1, 16, side, side, **bf16)
        ctx, pooled = torch.randn(1, CTX, 4096, **bf16), torch.randn(1, 2048, **bf16)
        t = torch.tensor([500.0], device="cuda")
        return (lambda: model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t,
                              return_dict=False)[0]), torch.randn_like(x)
    lora_step.diffusers_steps(res, model, configs, make_inputs, a.repeats, a.warmup, prefix=f"{which}_",
                              peers=a.peer)


def budget_part(res, a):
    """SD3.5 Large through the trainer under max_gpu_memory with fp8 storage."""
    lora_step.trainer_budget_run(res, f"budget_{a.budget}GiB_fp8", "sd35l_budget", "sd3", "sd3.5-large", a.budget,
                                 CTX, a.warmup, a.repeats)


def budget_report(res, a):
    b = a.budget
    f, p = res.get(f"budget_{b}GiB_fp8_step_ms"), res.get("diffusers_step_large_1024_ckpt_ms")
    return common.table(["setting", "FLAME ms", "driver peak GiB", "peer ckpt ms", "ratio"],
                        [[f"SD3.5 Large, max_gpu_memory {b} GiB, fp8", f,
                          res.get(f"budget_{b}GiB_fp8_driver_peak_GiB"), p, common.ratio(f, p)]])


def main():
    ap = lora_step.parser(__doc__, quantize=True)
    ap.add_argument("--models", default="large,medium")
    ap.add_argument("--budget", type=float, default=10, help="GiB for the fp8 trainer run (0: skip it)")
    a = ap.parse_args()
    configs = lora_step.configs_from(a.sizes, a.ckpt)
    models = [m for m in a.models.split(",") if m]
    res = common.Results("sd3_lora")
    ours = [(f"FLAME {m} {q}", lambda m=m, q=q: flame_part(res, m, configs, a, q)) for m in models
            for q in a.quantize]
    if a.budget:
        ours.append((f"FLAME trainer, SD3.5 Large, {a.budget} GiB, fp8", lambda: budget_part(res, a)))
    reports = [lambda m=m, q=q: lora_step.report(
        res, configs, f"\nSD3.5 {m} LoRA r16 (attention) step, bf16 autocast, batch 1, {CTX} context tokens (median "
                      f"ms; peak allocated GiB)" + lora_step.graph_note(a)
                      + lora_step.variant_note(q, a.fp8_cache_transposes),
        prefix=f"{m}_", flame_prefix=f"{m}_{lora_step.variant_prefix(q)}") for m in models for q in a.quantize]
    reports += [lambda: budget_report(res, a)] if a.budget else []
    lora_step.run(res, a, ours, [(f"diffusers+PEFT {m}", lambda m=m: diffusers_part(res, m, configs, a))
                                 for m in models], reports)


if __name__ == "__main__":
    main()
