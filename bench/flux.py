"""Flux-dev-size transformer forward (11.9B params, bf16, random init, batch 1, T5 length 512): FLAME side by side
with diffusers' FluxTransformer2DModel in the same process, at 512x512 (1024 image tokens) and 1024x1024 (4096).

Timing: CUDA events around each forward after warm-up, median of repeats (host launch time included, as a user
sees it); FLAME also as a CUDA graph (the sampler's mode, flame_models.flux.sample). Peak memory:
max_memory_allocated over the timed forwards (weights included), reset just before them; the graph's at capture.
One double and one single block alone at each size follow for both frameworks (as launched, and GPU time alone
behind a queued memset).
Run: PYTHONPATH=$PWD python3 bench/flux.py [--sizes 512,1024] [--repeats 5]
"""
import argparse
import gc
import sys

import common
import numpy as np


def flame_part(res, sizes, repeats, warmup):
    import flame_core as flame
    import flame_core.memory as fmem
    model = common.random_flux("flux-dev")
    res.log("flame_params", sum(p.numel() for p in model.parameters()))
    res.log("flame_weights_GiB", common.gib(fmem.memory_allocated()))
    with flame.no_grad():
        for size in sizes:
            args, _ = common.flame_flux_inputs(size, guidance=3.5)
            o = model(**args).float().numpy()
            assert o.shape == (1, (size // 16) ** 2, 64) and np.isfinite(o).all() and np.abs(o).mean() > 0, \
                "degenerate output"
            fmem.reset_peak_memory_stats()
            ms, host, _ = common.cuda_ms(lambda: model(**args), repeats, warmup)
            res.log(f"flame_fwd_{size}_ms", round(ms, 1))
            res.log(f"flame_fwd_{size}_host_ms", round(host, 1))
            res.log(f"flame_fwd_{size}_peak_GiB", common.gib(fmem.max_memory_allocated(), 3))
            keys = ("img", "txt", "y", "timesteps", "guidance")
            fwd = flame.cuda.graphed(lambda *a: model(**dict(args, **dict(zip(keys, a)))), warmup=1)

            def call():
                return fwd(*(args[k] for k in keys))
            call()  # eager warm-up
            fmem.reset_peak_memory_stats()
            call()  # the capture: every buffer of the graph is allocated (and freed) once
            res.log(f"flame_fwd_{size}_graph_capture_peak_GiB", common.gib(fmem.max_memory_allocated(), 3))
            fmem.reset_peak_memory_stats()
            res.log(f"flame_fwd_{size}_graph_ms", round(common.cuda_ms(call, repeats, warmup)[0], 1))
            res.log(f"flame_fwd_{size}_graph_peak_reserved_GiB", common.gib(fmem.max_memory_reserved(), 3))
            fwd.reset()
            fwd = call = None  # frees the graph (rebound, not deleted: closures use the names)
            flame_blocks(res, model, size, repeats, warmup)
    model = None  # frees the weights (rebound, not deleted: closures use the name)
    gc.collect()
    fmem.empty_cache()


def flame_blocks(res, model, size, repeats, warmup):
    """One double and one single block: (as launched, GPU alone) ms."""
    import flame_core as flame
    from flame_models.flux import ops
    from flame_models.flux import sampling as S
    n_img, H = (size // 16) ** 2, 3072
    g = flame.Generator("cuda").manual_seed(7)

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
    img, txt, vec = rnd(1, n_img, H), rnd(1, common.T5_LEN, H), rnd(1, H)
    ids = flame.cat((S.text_ids(common.T5_LEN, device="cuda"), S.image_ids(size, size, device="cuda")), dim=1)
    pe = ops.rope_rows(model.pe_embedder(ids), 1)
    x = flame.cat((txt, img), dim=1)
    for name, fn in (("double", lambda: model.double_blocks[0](img, txt, vec, pe)),
                     ("single", lambda: model.single_blocks[0](x, vec, pe))):
        res.log(f"flame_{name}_block_{size}_ms_gpu", (round(common.cuda_ms(fn, repeats, warmup)[0], 3), round(
            common.cuda_ms(fn, repeats, 1, before=common.busy_gpu())[0], 3)))


def diffusers_part(res, sizes, repeats, warmup):
    import torch
    model = common.diffusers_flux()
    res.log("diffusers_params", sum(p.numel() for p in model.parameters()))
    res.log("diffusers_weights_GiB", common.gib(torch.cuda.memory_allocated()))
    with torch.no_grad():
        for size in sizes:
            kw = common.diffusers_inputs(size, guidance=3.5)
            torch.cuda.reset_peak_memory_stats()
            ms = common.cuda_ms(lambda: model(**kw), repeats, warmup, lib="torch")[0]
            res.log(f"diffusers_fwd_{size}_ms", round(ms, 1))
            res.log(f"diffusers_fwd_{size}_peak_GiB", common.gib(torch.cuda.max_memory_allocated(), 3))
            n_img = (size // 16) ** 2
            img = torch.randn(1, n_img, 3072, device="cuda", dtype=torch.bfloat16)
            txt = torch.randn(1, common.T5_LEN, 3072, device="cuda", dtype=torch.bfloat16)
            temb = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
            rot = model.pos_embed(torch.cat((kw["txt_ids"], kw["img_ids"]), dim=0))
            for name, blk in (("double", model.transformer_blocks[0]), ("single", model.single_transformer_blocks[0])):
                fn = (lambda b: lambda: b(img, txt, temb, image_rotary_emb=rot))(blk)
                res.log(f"diffusers_{name}_block_{size}_ms_gpu", (
                    round(common.cuda_ms(fn, repeats, warmup, lib="torch")[0], 3),
                    round(common.cuda_ms(fn, repeats, 1, lib="torch", before=common.busy_gpu("torch"))[0], 3)))


def report(res, sizes):
    rows = []
    for s in sizes:
        f, g, d = res.get(f"flame_fwd_{s}_ms"), res.get(f"flame_fwd_{s}_graph_ms"), res.get(f"diffusers_fwd_{s}_ms")
        rows.append([f"{s}x{s}", f, g, d, common.ratio(f, d), common.ratio(g, d),
                     f"{res.get(f'flame_fwd_{s}_peak_GiB')} / {res.get(f'flame_fwd_{s}_graph_capture_peak_GiB')}",
                     res.get(f"diffusers_fwd_{s}_peak_GiB")])
    return common.table(["size", "FLAME eager ms", "FLAME graph ms", "diffusers ms", "eager ratio", "graph ratio",
                         "FLAME GiB eager / graph", "diffusers GiB"], rows,
                        title="\nFlux-dev forward, bf16, batch 1, T5 512 (median ms; peak allocated GiB incl. weights)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-diffusers", action="store_true")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    res = common.Results("flux")
    parts = [("FLAME", lambda: flame_part(res, sizes, a.repeats, a.warmup))]
    if not a.skip_diffusers:
        parts.append(("diffusers", lambda: diffusers_part(res, sizes, a.repeats, a.warmup)))
    failed = common.run_parts(res, parts)
    print(report(res, sizes), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
