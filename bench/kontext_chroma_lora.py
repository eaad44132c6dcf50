"""Flux Kontext and Chroma LoRA training steps at 1024²: FLAME side by side with diffusers + PEFT (eager and compiled)
in the same process (issue 43).

bench/lora_step.py's protocol (random bf16 base at the real size, LoRA r16 a16 on to_q / to_k / to_v / to_out.0 -- in
FLAME the same rows of BFL's fused qkv / linear1 and the out projections -- fp32 adapters, AdamW, bf16 autocast,
batch 1, MSE against a random target), gradient checkpointing on and off:
  kontext  FLUX.1 Kontext [dev] (Flux-dev's transformer): the noisy target's 4096 tokens with a 1024² reference
           image's 4096 tokens appended (ids (1, r, c)), T5 512 + pooled CLIP, guidance 1.0; the loss on the
           target's tokens only (the prediction's first 4096 tokens), as FLAME's trainer and diffusers' Kontext
           training scripts do
  chroma   Chroma1 (8.9B; no CLIP, the approximator's modulations): T5 512 with its padding mask (REAL_TOKENS real
           tokens; FLAME attends them and the first padding token; the peer gets ChromaPipeline's mask, the same
           tokens plus every image token, which diffusers 0.42.1 hands to SDPA as a float bias). FLAME's input is
           what its trainer feeds the model (--text-cut on, the default): the tokens no attention sees cut
           (flame_models/data/text_trim.py; a run whose captions all have REAL_TOKENS tokens keeps 129, unmasked);
           --text-cut off gives it the 512 tokens and the mask
The peer: diffusers' FluxTransformer2DModel / ChromaTransformer2DModel + PEFT, eager, then compiled (regional:
compile_repeated_blocks(fullgraph=True), fused AdamW), as bench/flux_lora.py and ../shared/peers/compiled_peer.py.

--budget B (default 12; 0 skips): each model trained by FLAME's trainer under max_gpu_memory B GiB with fp8 block
storage (model.quantize), random weights, synthetic 1024² samples (Kontext's with a control latent of the target's
size), T5 512, the attention LoRA, gradient checkpointing, as bench/sd3_lora.py's budget run. Timed: whole train_step
calls (median, after the trainer's warm-up); the driver's device-memory peak (cudaMemGetInfo, polled) over setup and
steps; the table's ratio is against the compiled peer's ckpt step of this run, else of a step run saved in the same
$OUT (kontext_chroma_lora_<model>.json).
--blocks D,S: D double and S single blocks instead of the real 19 / 38 (a short smoke run on the GPU; the benches
have no CPU mode: they time CUDA events).
Run: PYTHONPATH=$PWD python3 bench/kontext_chroma_lora.py [--models kontext,chroma] [--ckpt on,off] [--repeats 5]
                                                           [--budget 12] [--only-budget] [--peer eager,compiled]
                                                           [--graph] [--blocks D,S]
"""
import dataclasses
import json
import os

import common
import lora_step
import numpy as np

T5 = common.T5_LEN
REAL_TOKENS = 128          # Chroma: real T5 tokens of the 512 (the rest padding)
PRESETS = {"kontext": ("flux_kontext", "flux-dev"), "chroma": ("chroma", "chroma")}
LABELS = {"kontext": "Flux Kontext [dev]", "chroma": "Chroma1"}


def _params(which, blocks):
    from flame_models.training.family import get_family
    arch, size = PRESETS[which]
    p = get_family(arch).preset(size)
    return p if not blocks else dataclasses.replace(p, depth=blocks[0], depth_single_blocks=blocks[1])


# ----------------------------------------------------------------------------- FLAME
def flame_part(res, which, configs, a):
    import flame_core as flame
    from flame_models.bfl.sampling import image_ids, text_ids
    from flame_models.flux_kontext import reference_ids, target_velocity, with_reference
    model, name_map = lora_step.family_model(PRESETS[which][0], _params(which, a.blocks))
    bf16 = dict(dtype=flame.bfloat16, device="cuda")

    def make_step(px):
        g = flame.Generator("cuda").manual_seed(1)
        n = (px // 16) ** 2

        def rnd(*shape):
            return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
        img, txt = rnd(1, n, 64), rnd(1, T5, 4096)
        ids, tids = image_ids(px, px, 1, device="cuda"), text_ids(T5, 1, device="cuda")
        t = flame.tensor([0.62], **bf16)
        target = flame.randn(1, n, 64, generator=g, device="cuda")
        if which == "kontext":
            ref, y = rnd(1, n, 64), rnd(1, 768)
            rids, guidance = reference_ids(px, px, 1, device="cuda"), flame.tensor([1.0], **bf16)

            def call(img, ref, txt, y):
                x, xids = with_reference(img, ids, ref, rids)
                v = model(img=x, img_ids=xids, txt=txt, txt_ids=tids, timesteps=t, y=y, guidance=guidance)
                return target_velocity(v, n)
            return lora_step.flame_loss(call), (img, ref, txt, y, target)
        mask, keep = (np.arange(T5) < REAL_TOKENS).astype(np.float32), T5
        if a.text_cut == "on":      # as FLAME's trainer cuts a run whose captions all hold REAL_TOKENS tokens
            from flame_models.data.text_trim import TextTrim
            from flame_models.training.family import get_family
            trim = TextTrim()
            keep = trim.plan([get_family("chroma").attended_text_length(mask)], T5)
            mask = mask[:keep] if trim.keep_mask else None
            txt, tids = txt[:, :keep].contiguous(), text_ids(keep, 1, device="cuda")
        res[f"flame_chroma_text_tokens_{px}"] = keep
        mask = None if mask is None else flame.tensor(mask[None], device="cuda")

        def call(img, txt):
            return model(img, ids, txt, tids, t, txt_mask=mask)
        return lora_step.flame_loss(call), (img, txt, target)
    lora_step.flame_steps(res, model, name_map, configs, make_step, a.repeats, a.warmup, a.graph, prefix=f"{which}_")
    model = None  # rebound, not deleted: closures above use the name
    lora_step.release_flame()


# ----------------------------------------------------------------------------- diffusers + PEFT
def diffusers_model(which, blocks):
    if which == "kontext":
        return common.diffusers_flux(blocks)
    import torch
    from diffusers import ChromaTransformer2DModel
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    nd, ns = blocks or (19, 38)
    return lora_step.build_torch(ChromaTransformer2DModel, patch_size=1, in_channels=64, num_layers=nd,
                                 num_single_layers=ns, attention_head_dim=128, num_attention_heads=24,
                                 joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
                                 approximator_hidden_dim=5120, approximator_layers=5)


def diffusers_part(res, which, configs, a):
    import torch
    model = diffusers_model(which, a.blocks)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def make_inputs(px):
        kw = common.diffusers_inputs(px, guidance=1.0)
        n = kw["hidden_states"].shape[1]
        target = torch.randn_like(kw["hidden_states"])
        if which == "kontext":   # FluxKontextPipeline's layout: cat([latents, image_latents]), reference ids (1, r, c)
            ref_ids = kw["img_ids"].clone()
            ref_ids[:, 0] = 1
            kw.update(hidden_states=torch.cat([kw["hidden_states"], torch.randn_like(kw["hidden_states"])], dim=1),
                      img_ids=torch.cat([kw["img_ids"], ref_ids], dim=0))
            return (lambda: model(**kw)[0][:, :n]), target
        for k in ("pooled_projections", "guidance"):
            kw.pop(k)
        # ChromaPipeline: the T5 mask over the real tokens and the first padding one, then ones for the image
        text = (torch.arange(T5, device="cuda") <= REAL_TOKENS).to(torch.bfloat16)[None]
        kw["attention_mask"] = torch.cat([text, torch.ones(1, n, **bf16)], dim=1)
        return (lambda: model(**kw)[0]), target
    lora_step.diffusers_steps(res, model, configs, make_inputs, a.repeats, a.warmup, prefix=f"{which}_",
                              peers=a.peer)


# ----------------------------------------------------------------------------- FLAME's trainer under a budget
def budget_part(res, which, a):
    """The model through FLAME's trainer under max_gpu_memory with fp8 storage."""
    arch, size = PRESETS[which]
    lora_step.trainer_budget_run(res, f"{which}_budget_{a.budget}GiB_fp8", f"{which}_budget", arch, size, a.budget,
                                 T5, a.warmup, a.repeats)


def peer_ms(res, which):
    """The compiled peer's 1024² ckpt step of `which`: this run's, else the one a step run of the same $OUT saved
    (kontext_chroma_lora_<which>.json: the budget runs go in their own process, apart from the peer)."""
    key = f"compiled_step_{which}_1024_ckpt_ms"
    if res.get(key) is not None:
        return res[key]
    path = os.path.join(os.environ.get("OUT") or "out", f"kontext_chroma_lora_{which}.json")
    try:
        with open(path) as f:
            return json.load(f)["results"].get(key)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def budget_report(res, a, models):
    rows = []
    for which in models:
        key = f"{which}_budget_{a.budget}GiB_fp8"
        f, p = res.get(f"{key}_step_ms"), peer_ms(res, which)
        rows.append([f"{LABELS[which]}, max_gpu_memory {a.budget} GiB, fp8", f, res.get(f"{key}_driver_peak_GiB"), p,
                     common.ratio(f, p)])
    return common.table(["setting", "FLAME ms", "driver peak GiB", "compiled peer ckpt ms", "ratio"], rows)


def main():
    ap = lora_step.parser(__doc__)
    ap.add_argument("--models", default="kontext,chroma")
    ap.add_argument("--budget", type=float, default=12, help="GiB for the fp8 trainer runs (0: skip them)")
    ap.add_argument("--blocks", default=None, type=lambda v: tuple(int(x) for x in v.split(",")),
                    help="double,single block counts (default: the real 19,38)")
    ap.add_argument("--only-budget", action="store_true", help="run the --budget trainer runs alone")
    ap.add_argument("--text-cut", choices=("on", "off"), default="on",
                    help="Chroma: FLAME gets the T5 tokens its trainer keeps (on) or all 512 with the mask (off)")
    a = ap.parse_args()
    if a.budget == int(a.budget):
        a.budget = int(a.budget)
    configs = lora_step.configs_from(a.sizes, a.ckpt)
    models = [m for m in a.models.split(",") if m]
    unknown = sorted(set(models) - set(PRESETS))
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(PRESETS)}")
    if a.only_budget and not a.budget:
        ap.error("--only-budget needs --budget > 0")
    # one results file per selection ($OUT/kontext_chroma_lora_<models>[_budget].json): split runs keep theirs
    res = common.Results("kontext_chroma_lora_" + "_".join(models) + ("_budget" if a.only_budget else ""))
    ours = [] if a.only_budget else [(f"FLAME {m}", lambda m=m: flame_part(res, m, configs, a)) for m in models]
    if a.budget:
        ours += [(f"FLAME trainer, {LABELS[m]}, {a.budget} GiB, fp8", lambda m=m: budget_part(res, m, a))
                 for m in models]
    ctx = {"kontext": f"{T5} T5 tokens, 1024² reference appended", "chroma": f"{T5} T5 tokens ({REAL_TOKENS} real"
           + (f"; FLAME: the {REAL_TOKENS + 1} its trainer keeps)" if a.text_cut == "on" else ")")}

    def step_report(m):
        return lora_step.report(res, configs, f"\n{LABELS[m]} LoRA r16 (attention) step, bf16 autocast, batch 1, "
                                              f"{ctx[m]} (median ms; peak allocated GiB)" + lora_step.graph_note(a),
                                prefix=f"{m}_")
    reports = [] if a.only_budget else [lambda m=m: step_report(m) for m in models]
    if a.budget:
        reports.append(lambda: budget_report(res, a, models))
    peers = [] if a.only_budget else [(f"diffusers+PEFT {m}", lambda m=m: diffusers_part(res, m, configs, a))
                                      for m in models]
    lora_step.run(res, a, ours, peers, reports)


if __name__ == "__main__":
    main()
