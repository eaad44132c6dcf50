"""A LoRA trained in fp8 compute and in bf16 on one small fixed task: loss curves side by side, and the learned LoRAs'
effect compared (issue 45's quality question: does training on the e4m3 tensor cores learn the same adapter?).

The task (fixed data, fixed seeds): recover a known LoRA. A real-width Flux (Flux-dev's width 3072, 24 heads, MLP
12288, T5 and CLIP widths) with --blocks double,single blocks (default 2,4), random N(0, 0.02) bf16 weights, gets a
"truth" LoRA (rank 16 on the attention projections, lora_step.TARGETS; A ~ N(0, 1/in), B ~ N(0, --truth-std^2)); its
bf16 outputs on --samples fixed inputs (512x512 latents = 1024 image tokens, --txt text tokens, random states) are the
targets. Then a fresh LoRA (the same init for every run: kaiming A, zero B) is trained to those targets, MSE, AdamW,
batch 1 cycling through the training samples, under bf16 autocast, once per mode:

    bf16                 the frozen base in bf16 (the reference)
    fp8_compute          the blocks' Linears in e4m3 (one scale per tensor), matmuls on the fp8 tensor cores
                         (flame_nn.offload.fp8_compute, its default accumulation)
    fp8_compute_precise  the same with the forward's partial sums promoted to fp32 (FAST_ACCUM_FORWARD off)
    fp8_delayed          fp8_compute with delayed scaling of the activations (flame_nn.offload.set_fp8_scaling_)

Reported: the loss every --every steps per mode; on held-out inputs (not trained on) each trained LoRA's MSE to the
targets and the fraction of the truth's effect it recovers, 1 - MSE(lora) / MSE(base) -- evaluated on the bf16 base
(where a LoRA trained on an fp8 base is used at bf16 inference) and on its own training base (for the fp8 modes the
fp8 base with the default accumulation); the fp8 base's floor (the truth LoRA itself on the fp8 base); and the LoRAs
compared with the bf16-trained one: the cosine and relative distance of their effects (output minus the base's
output, held out) and of their weight deltas s*B@A (all layers concatenated).
Run: PYTHONPATH=$PWD python3 bench/fp8_lora_quality.py [--steps 300] [--modes bf16,fp8_compute,fp8_compute_precise]
     (cpu smoke run: --preset flux-tiny --device cpu --size 64 --txt 8 --steps 20; fp8 compute is emulated there)
"""
import argparse
import time

import common
import lora_step
import numpy as np

MODES = ("bf16", "fp8_compute", "fp8_compute_precise", "fp8_delayed")


def _inputs(p, size, n_txt, seed, device):
    """Flux's keyword arguments for one fixed sample (batch 1): random latents, text states and pooled vector."""
    import flame_core as flame
    from flame_models.flux import sampling as S
    g = flame.Generator(device).manual_seed(seed)
    tokens = (size // 16) ** 2

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device=device).to(flame.bfloat16)
    bf16 = dict(dtype=flame.bfloat16, device=device)
    kw = dict(img=rnd(1, tokens, p.in_channels), img_ids=S.image_ids(size, size, device=device),
              txt=rnd(1, n_txt, p.context_in_dim), txt_ids=S.text_ids(n_txt, device=device),
              y=rnd(1, p.vec_in_dim), timesteps=flame.tensor([0.3 + 0.4 * (seed % 7) / 6], **bf16))
    if p.guidance_embed:
        kw["guidance"] = flame.tensor([3.5], **bf16)
    return kw


def _build(p, a, mode):
    """The model of one mode with the LoRA injected at its fixed init: (model, lora parameters, adapter modules)."""
    import flame_core as flame
    from flame_models.flux.lora_keys import name_map_for
    from flame_nn import adapters as A
    from flame_nn.offload import quantize_linear_weights_
    chunk = 1 << 26 if flame.device(a.device).type == "cuda" else 1 << 16   # cpu: each parameter draws a chunk
    model = common.random_flux(p, device=a.device, seed=0, chunk=chunk)
    model.requires_grad_(False)
    if mode != "bf16":
        for stack in (model.double_blocks, model.single_blocks):
            quantize_linear_weights_(stack, compute="fp8")
    A.inject_adapters(model, lora_step.TARGETS, "lora", rank=a.rank, alpha=a.rank, name_map=name_map_for(p),
                      generator=flame.Generator(a.device).manual_seed(1))
    return model, A.adapter_parameters(model), A.adapter_modules(model)


def _set(params, values):
    import flame_core as flame
    with flame.no_grad():
        for prm, v in zip(params, values):
            prm.copy_(v)


def _truth(model, std, device):
    """The truth LoRA's values in adapter_parameters' order: A (r, in) ~ N(0, 1/in), B (out, r) ~ N(0, std^2)."""
    import flame_core as flame
    from flame_nn import adapters as A
    g = flame.Generator(device).manual_seed(2)
    out = []
    for name, prm in A.named_adapter_parameters(model):
        shape = tuple(prm.shape)
        sd = 1.0 / np.sqrt(shape[1]) if name.endswith("lora_A") else std
        out.append((flame.randn(*shape, generator=g, device=device) * sd).to(prm.dtype))
    return out


def _predict(model, kws):
    import flame_core as flame
    from flame_core import amp
    outs = []
    with flame.no_grad(), amp.autocast(flame.device(kws[0]["img"].device).type, dtype=flame.bfloat16):
        for kw in kws:
            outs.append(model(**kw).float())
    return outs


def _mse(preds, targets):
    return float(np.mean([float(((p - t) ** 2).mean().item()) for p, t in zip(preds, targets)]))


def _np(ts):
    return np.concatenate([t.detach().float().cpu().numpy().ravel() for t in ts])


def _cos_rel(a, b):
    """(cosine, ||a - b|| / ||b||) of two flat arrays."""
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / max(na * nb, 1e-30)), float(np.linalg.norm(a - b) / max(nb, 1e-30))


def _train(model, lora, train, targets, a, res, mode):
    """Train `lora` from its current values: a.steps AdamW steps, batch 1 cycling through `train`; with a.graph the
    forward + backward replayed as a CUDA graph after 2 eager steps (lora_step's protocol). Returns the losses."""
    import flame_core as flame
    import flame_nn
    from flame_core import amp
    from flame_nn.offload import fp8_compute as FC
    fast = FC.FAST_ACCUM_FORWARD
    FC.FAST_ACCUM_FORWARD = False if mode == "fp8_compute_precise" else fast
    dev = flame.device(a.device).type
    varying = ("img", "txt", "y", "timesteps")
    fixed = {k: v for k, v in train[0].items() if k not in varying}   # ids and guidance: the same for every sample

    def fwd_bwd(img, txt, y, timesteps, target):
        with amp.autocast(dev, dtype=flame.bfloat16):
            pred = model(**fixed, img=img, txt=txt, y=y, timesteps=timesteps)
        loss = ((pred.float() - target) ** 2).mean()
        loss.backward()
        return loss.detach()
    run = flame.cuda.graphed(fwd_bwd, warmup=2, enabled=a.graph)
    opt = flame_nn.optim.AdamW(lora, lr=a.lr, weight_decay=0.0)
    model.train()
    losses = []
    t0 = time.perf_counter()
    try:
        for step in range(a.steps):
            i = step % len(train)
            loss = run(*(train[i][k] for k in varying), targets[i])
            opt.step()
            opt.zero_grad(set_to_none=not a.graph)
            losses.append(loss.clone() if a.graph else loss)
        losses = [float(v.item()) for v in losses]
    finally:
        FC.FAST_ACCUM_FORWARD = fast
        run.reset()
        opt.zero_grad(set_to_none=True)
    model.eval()
    res.log(f"{mode}_train_s", round(time.perf_counter() - t0, 2))
    if not all(np.isfinite(losses)):
        raise FloatingPointError(f"{mode}: non-finite loss {losses}")
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flux-dev", help="the Flux preset whose widths the model has")
    ap.add_argument("--blocks", default="2,4", help="double,single block counts")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (tokens = (size/16)^2)")
    ap.add_argument("--txt", type=int, default=128, help="text tokens")
    ap.add_argument("--samples", type=int, default=6, help="training samples (fixed inputs)")
    ap.add_argument("--held-out", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--truth-std", type=float, default=0.1, help="std of the truth LoRA's B")
    ap.add_argument("--every", type=int, default=10, help="loss table: one row per this many steps (mean over them)")
    ap.add_argument("--modes", default=",".join(MODES), type=lambda v: tuple(v.split(",")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-graph", dest="graph", action="store_false",
                    help="eager training steps (default: forward + backward as a CUDA graph after 2 eager steps)")
    a = ap.parse_args(argv)
    if not a.modes or set(a.modes) - set(MODES) or a.modes[0] != "bf16":
        ap.error(f"--modes: bf16 first, then any of {', '.join(MODES[1:])}; got {','.join(a.modes)}")
    if min(a.steps, a.samples, a.held_out, a.every, a.rank) < 1 or a.size % 16:
        ap.error("--steps, --samples, --held-out, --every and --rank must be >= 1 and --size a multiple of 16")
    from flame_models.flux.params import flux_params
    t_start = time.perf_counter()
    res = common.Results("fp8_lora_quality")
    n_double, n_single = (int(v) for v in a.blocks.split(","))
    p = flux_params(a.preset).replace(depth=n_double, depth_single_blocks=n_single)
    kws = [_inputs(p, a.size, a.txt, 100 + i, a.device) for i in range(a.samples + a.held_out)]
    train, held = kws[:a.samples], kws[a.samples:]

    # the bf16 model: targets from the truth LoRA, the base's own outputs, the LoRAs' held-out evaluation
    ref, ref_lora, ref_mods = _build(p, a, "bf16")
    res.log("lora_params", sum(q.numel() for q in ref_lora))
    init = [q.detach().clone() for q in ref_lora]
    truth = _truth(ref, a.truth_std, a.device)
    _set(ref_lora, truth)
    targets, held_targets = _predict(ref, train), _predict(ref, held)
    _set(ref_lora, [q * 0 for q in init])   # B = 0: the base alone
    held_base = _predict(ref, held)
    base_mse = res.log("held_out_base_mse", _mse(held_base, held_targets))
    res.log("target_rms", float(np.sqrt(np.mean([float((t ** 2).mean().item()) for t in held_targets]))))

    curves, trained, own = {}, {}, {}
    fp8_model = fp8_lora = None
    for mode in a.modes:
        common.section(mode)
        if mode == "bf16":
            model, lora = ref, ref_lora
        else:   # the fp8 modes train on one fp8 model (they differ in the forward's accumulation or the scaling)
            from flame_nn.offload import set_fp8_scaling_
            if fp8_model is None:
                fp8_model, fp8_lora, _ = _build(p, a, "fp8_compute")
                _set(fp8_lora, truth)   # the floor: the truth LoRA itself on the fp8 base
                res.log("fp8_held_out_floor_mse", _mse(_predict(fp8_model, held), held_targets))
            model, lora = fp8_model, fp8_lora
            for stack in (model.double_blocks, model.single_blocks):   # fresh sites (no history) per mode
                set_fp8_scaling_(stack, "delayed" if mode == "fp8_delayed" else "current")
        _set(lora, init)
        curves[mode] = _train(model, lora, train, targets, a, res, mode)
        trained[mode] = [q.detach().clone() for q in lora]
        own[mode] = res.log(f"{mode}_held_out_mse_own_base", _mse(_predict(model, held), held_targets))
    model = lora = fp8_model = fp8_lora = None

    rows = []
    ref_effect = ref_delta = None
    for mode in a.modes:   # every LoRA on the bf16 base
        _set(ref_lora, trained[mode])
        preds = _predict(ref, held)
        mse = res.log(f"{mode}_held_out_mse_bf16_base", _mse(preds, held_targets))
        effect = _np(preds) - _np(held_base)
        delta = np.concatenate([ad.delta_weight().detach().float().cpu().numpy().ravel() for _, _, ad in ref_mods])
        if mode == "bf16":
            ref_effect, ref_delta = effect, delta
        ce, re = _cos_rel(effect, ref_effect)
        cw, rw = _cos_rel(delta, ref_delta)
        for k, v in (("recovered_bf16_base", 1 - mse / base_mse), ("recovered_own_base", 1 - own[mode] / base_mse),
                     ("effect_cos_vs_bf16", ce), ("effect_rel_vs_bf16", re), ("delta_w_cos_vs_bf16", cw),
                     ("delta_w_rel_vs_bf16", rw)):
            res.log(f"{mode}_{k}", round(v, 5))
        rows.append([mode, f"{curves[mode][0]:.4g}", f"{np.mean(curves[mode][-a.every:]):.4g}", f"{mse:.4g}",
                     round(1 - mse / base_mse, 4), f"{own[mode]:.4g}", round(1 - own[mode] / base_mse, 4),
                     round(ce, 4), round(re, 4), round(cw, 4), round(rw, 4)])
    for mode in a.modes:
        res.log(f"{mode}_loss_curve", [float(f"{v:.6g}") for v in curves[mode]])
    res.log("total_s", round(time.perf_counter() - t_start, 1))
    res.save()

    curve_rows = [[f"{s + 1}-{min(s + a.every, a.steps)}"] + [f"{np.mean(curves[m][s:s + a.every]):.5g}"
                                                               for m in a.modes]
                  for s in range(0, a.steps, a.every)]
    print(common.table(["steps"] + list(a.modes), curve_rows,
                       title=f"\nLoRA r{a.rank} recovering a truth LoRA, {a.preset} widths, blocks {a.blocks}, "
                             f"{(a.size // 16) ** 2}+{a.txt} tokens, AdamW lr {a.lr}: training loss (mean per "
                             f"{a.every} steps)"))
    print(common.table(["mode", "loss first", "loss last", "held-out MSE (bf16 base)", "recovered", "MSE (own base)",
                        "recovered (own)", "effect cos", "effect rel", "dW cos", "dW rel"], rows,
                       title=f"\nheld out ({a.held_out} samples; base alone: MSE {base_mse:.4g}); effect and dW "
                             f"compared with the bf16-trained LoRA"))


if __name__ == "__main__":
    main()
