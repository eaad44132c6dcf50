"""Optimizer step time over a LoRA's parameters: FLAME's optimizers against PyTorch's in the same process.

The parameter set is the LoRA r16 on the attention projections of a real model (float32 adapters, one down and one up
matrix per adapted Linear): `sdxl` (70 transformer blocks, attn1 q/k/v/out and attn2 q/k/v/out at 640 / 1280
channels, 2048-wide text keys: 1120 tensors, 23.2 M), `flux` (to_q / to_k / to_v / to_out.0 of the 19 double
blocks' image stream and to_q / to_k / to_v of the 38 single blocks, at 3072: 380 tensors, 18.7 M), `sd3.5-large`
(to_q / to_k / to_v / to_out.0 of the 38 joint blocks' image stream, at 2432: 304 tensors, 11.8 M) -- the
parameter counts of the LoRA-step benches' adapters. Gradients are random (the same every step), the
learning rate 1e-4.
Full fine-tuning sets (`sdxl-full`, `flux-full`): every parameter of the SDXL UNet (1680 tensors, 2.57 B: 743
matrices, 886 vectors, 51 convolution kernels) or of Flux-dev's transformer (780 tensors, 11.9 B) in bfloat16 with
bfloat16 gradients, as `train.full_bf16` trains them: FLAME's Adafactor and AdamW8bit (their stochastic rounding)
against transformers' Adafactor (the optimizer kohya's full_bf16 recipe uses; its bf16 copy-back rounds to nearest)
and torch's fused AdamW on the same bf16 parameters.
Timed per optimizer: one `step()` between CUDA events after --warmup steps, median of --repeats, and the host's time
of issuing it. FLAME: AdamW (fused, on pooled gradients as the trainer registers them), AdamW8bit (fused; and its
per-operation path inside loader.reference() with --per-op), Lion, Prodigy, AdamWScheduleFree, Adafactor. torch:
torch.optim.AdamW (fused=True), and prodigyopt.Prodigy / lion_pytorch.Lion / schedulefree.AdamWScheduleFree where
importable (bitsandbytes' 8-bit AdamW is not on the lent image).
Run: PYTHONPATH=$PWD python3 bench/optimizers.py [--sets sdxl,flux,sdxl-full] [--repeats 10] [--warmup 3] [--per-op]
"""
import argparse

import common
import numpy as np

R = 16


FULL = {"sdxl-full": ("sdxl", "sdxl-base"), "flux-full": ("flux", "flux-dev")}


def full_shapes(which):
    """The shapes of every parameter of a full fine-tune set's model (an empty model on the cpu: nothing touched)."""
    import flame_core as flame
    from flame_models.training.family import get_family
    arch, size = FULL[which]
    fam = get_family(arch)
    model = fam.empty_model(fam.preset(size), flame.bfloat16, "cpu")
    return [tuple(p.shape) for p in model.parameters()]


def shapes_of(which):
    return full_shapes(which) if which in FULL else lora_shapes(which)


def lora_shapes(which):
    """[(rows, cols)] of the LoRA's down and up matrices for the adapted Linears (in, out) of `which`."""
    lin = []
    if which == "sdxl":
        for width, n in ((640, 10), (1280, 60)):  # 10 blocks at 640 channels, 60 at 1280: 70 in all
            for _ in range(n):
                lin += [(width, width)] * 4 + [(width, width), (2048, width), (2048, width), (width, width)]
    elif which == "flux":
        lin = [(3072, 3072)] * (4 * 19 + 3 * 38)
    elif which == "sd3.5-large":
        lin = [(2432, 2432)] * (4 * 38)
    else:
        raise ValueError(f"--sets: sdxl, flux, sd3.5-large, sdxl-full or flux-full, got {which!r}")
    return [s for i, o in lin for s in ((R, i), (o, R))]


def flame_part(res, which, a):
    import flame_core as flame
    import flame_nn as nn
    from flame_core import grad_pool
    from flame_core.kernels import loader
    shapes = shapes_of(which)
    res.log(f"{which}_tensors", len(shapes))
    res.log(f"{which}_params", int(sum(int(np.prod(s)) for s in shapes)))
    if which in FULL:
        return flame_full(res, which, a, shapes)
    rng = np.random.default_rng(0)
    kinds = [("AdamW", lambda ps: nn.optim.AdamW(ps, lr=1e-4), False),
             ("AdamW8bit", lambda ps: nn.optim.AdamW8bit(ps, lr=1e-4), False)]
    if a.per_op:
        kinds.append(("AdamW8bit per-op", lambda ps: nn.optim.AdamW8bit(ps, lr=1e-4), True))
    kinds += [("Lion", lambda ps: nn.optim.Lion(ps, lr=1e-5), False),
              ("Prodigy", lambda ps: nn.optim.Prodigy(ps, lr=1.0), False),
              ("AdamWScheduleFree", lambda ps: nn.optim.AdamWScheduleFree(ps, lr=1e-4), False),
              ("Adafactor", lambda ps: nn.optim.Adafactor(ps, lr=1e-4, relative_step=False, scale_parameter=False),
               False)]
    grads = [rng.standard_normal(s).astype(np.float32) * 1e-2 for s in shapes]
    for name, make, reference in kinds:
        params = [nn.Parameter(flame.tensor(rng.standard_normal(s).astype(np.float32) * 0.02, device="cuda"))
                  for s in shapes]
        grad_pool.register(params)  # as the trainer does: the gradients are views of flat buffers
        for p, g in zip(params, grads):
            view = grad_pool.pooled_grad(p)
            view.array[...] = flame.tensor(g, device="cuda").array
            p.grad = view
        opt = make(params)
        if hasattr(opt, "train"):  # schedule-free: train mode for stepping
            opt.train()
        step = opt.step
        try:
            if reference:
                with loader.reference():
                    ms, host, _ = common.cuda_ms(step, a.repeats, a.warmup)
            else:
                ms, host, _ = common.cuda_ms(step, a.repeats, a.warmup)
            res.log(f"flame_{which}_{name}_ms", round(ms, 3))
            res.log(f"flame_{which}_{name}_host_ms", round(host, 3))
        except Exception as e:  # an optimizer that fails is reported, the others still run
            res.log(f"flame_{which}_{name}_ms", f"error: {str(e).splitlines()[0]}")
        grad_pool.unregister(params)
        opt = params = step = None


def _adafactor_kw():
    return dict(lr=1e-4, relative_step=False, scale_parameter=False, warmup_init=False)


def flame_full(res, which, a, shapes):
    """bf16 parameters and gradients made on the GPU (a host copy of Flux-dev's would be 48 GB)."""
    import flame_core as flame
    import flame_nn as nn
    for name, make in (("Adafactor", lambda ps: nn.optim.Adafactor(ps, **_adafactor_kw())),
                       ("AdamW8bit", lambda ps: nn.optim.AdamW8bit(ps, lr=1e-4))):
        flame.manual_seed(0)
        params = [nn.Parameter(flame.randn(*s, device="cuda", dtype=flame.bfloat16) * 0.02) for s in shapes]
        for p in params:
            p.grad = flame.randn(*p.shape, device="cuda", dtype=flame.bfloat16) * 1e-2
        opt = make(params)
        try:
            ms, host, _ = common.cuda_ms(opt.step, a.repeats, a.warmup)
            res.log(f"flame_{which}_{name}_ms", round(ms, 3))
            res.log(f"flame_{which}_{name}_host_ms", round(host, 3))
            assert all(p.dtype == flame.bfloat16 for p in params)
        except Exception as e:  # an optimizer that fails is reported, the others still run
            res.log(f"flame_{which}_{name}_ms", f"error: {str(e).splitlines()[0]}")
        opt = params = None
        flame.memory.empty_cache()


def torch_full(res, which, a, shapes):
    import torch
    kinds = [("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))]
    try:
        from transformers.optimization import Adafactor
        kinds.insert(0, ("Adafactor", lambda ps: Adafactor(ps, **_adafactor_kw())))
    except ImportError:
        res.log(f"torch_{which}_Adafactor_ms", "transformers not importable")
    for name, make in kinds:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", dtype=torch.bfloat16) * 1e-2
        opt = make(params)
        ms, host, _ = common.cuda_ms(opt.step, a.repeats, a.warmup, lib="torch")
        res.log(f"torch_{which}_{name}_ms", round(ms, 3))
        res.log(f"torch_{which}_{name}_host_ms", round(host, 3))
        opt = params = None
        torch.cuda.empty_cache()


def torch_part(res, which, a):
    import torch
    shapes = shapes_of(which)
    if which in FULL:
        return torch_full(res, which, a, shapes)
    rng = np.random.default_rng(0)
    kinds = [("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))]
    for mod, cls, name, kw in (("lion_pytorch", "Lion", "Lion", dict(lr=1e-5)),
                               ("prodigyopt", "Prodigy", "Prodigy", dict(lr=1.0)),
                               ("schedulefree", "AdamWScheduleFree", "AdamWScheduleFree", dict(lr=1e-4))):
        try:
            kinds.append((name, lambda ps, c=getattr(__import__(mod), cls), kw=kw: c(ps, **kw)))
        except ImportError:
            res.log(f"torch_{which}_{name}_ms", f"{mod} not importable")
    grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 1e-2).cuda() for s in shapes]
    for name, make in kinds:
        params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = make(params)
        if name == "AdamWScheduleFree":
            opt.train()
        ms, host, _ = common.cuda_ms(opt.step, a.repeats, a.warmup, lib="torch")
        res.log(f"torch_{which}_{name}_ms", round(ms, 3))
        res.log(f"torch_{which}_{name}_host_ms", round(host, 3))
        opt = params = None


def report(res, sets):
    rows = []
    for which in sets:
        for name in ("AdamW", "AdamW8bit", "AdamW8bit per-op", "Lion", "Prodigy", "AdamWScheduleFree", "Adafactor"):
            f, t = res.get(f"flame_{which}_{name}_ms"), res.get(f"torch_{which}_{name}_ms")
            if f is None and t is None:
                continue
            rows.append([which, name, f, res.get(f"flame_{which}_{name}_host_ms"), t,
                         common.ratio(f, t if isinstance(t, float) else res.get(f"torch_{which}_AdamW_ms"))])
    return common.table(["set", "optimizer", "FLAME ms", "FLAME host ms", "torch ms", "÷ torch (AdamW where none)"],
                        rows, title="\nOptimizer step over a LoRA r16's float32 parameters, or (-full sets) a whole "
                                    "model's bf16 ones (median ms between CUDA events; host ms: issuing the step)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="sdxl,flux")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--per-op", action="store_true", help="also AdamW8bit's per-operation path (slow)")
    a = ap.parse_args()
    sets = [s for s in a.sets.split(",") if s]
    for s in sets:
        if s not in FULL:
            lora_shapes(s)
    res = common.Results("optimizers")
    parts = [(f"FLAME {s}", lambda s=s: flame_part(res, s, a)) for s in sets]
    if common.import_torch() is not None:
        parts += [(f"torch {s}", lambda s=s: torch_part(res, s, a)) for s in sets]
    failed = common.run_parts(res, parts)
    print(report(res, sets), flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
