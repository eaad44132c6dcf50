"""Flux-dev-size transformer forward (11.9B params, bf16, random init, batch 1, T5 length 512): FLAME side by side
with diffusers' FluxTransformer2DModel in the same process, at 512x512 (1024 image tokens) and 1024x1024 (4096).

Timing: CUDA events around each forward after warm-up, median of repeats (host launch time included, as a user
sees it). Peak memory: flame_core.memory.max_memory_allocated / torch.cuda.max_memory_allocated over the timed
forwards (weights included), reset just before them. A per-block breakdown at 1024x1024 (one double block, one
single block, their GEMMs alone, attention alone) follows for both frameworks.

Run on the device (diffusers from a carried wheel, see shared/PEERS.md):
    PYTHONPATH=$PWD python3 bench/flux.py [--sizes 512,1024] [--repeats 5]
Writes $OUT/flux_bench.json (or ./flux_bench.json) and prints a table last.
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
R = {}


def log(key, value):
    R[key] = value
    print(f"{key}: {value}", flush=True)


def section(name):
    print(f"\n== {name} ({time.strftime('%X')})", flush=True)


def gib(nbytes):
    return round(nbytes / 2 ** 30, 2)


# ----------------------------------------------------------------------------- FLAME
_BUSY = []


def _busy_gpu():
    """~6 ms of GEMMs queued ahead of a timed region: its kernels are then all launched before the GPU reaches
    them, so the events measure GPU time alone, without the host's launch gaps."""
    import cupy as cp
    if not _BUSY:
        a = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.dtype("bfloat16"))
        _BUSY.extend([a, cp.empty_like(a)])
    a, c = _BUSY
    for _ in range(4):
        cp.matmul(a, a, out=c)


def cuda_time(fn, repeats, warmup, gpu_only=False):
    """Median ms of fn() between CUDA events (cupy), after warm-up; also the median host time to launch it.
    gpu_only: queue busy work first, so that the events see the GPU time of fn's kernels only."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    ms, host = [], []
    for _ in range(repeats):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        if gpu_only:
            _busy_gpu()
        s.record()
        t = time.perf_counter()
        out = fn()
        host.append((time.perf_counter() - t) * 1e3)
        e.record()
        e.synchronize()
        ms.append(cp.cuda.get_elapsed_time(s, e))
        del out
    return statistics.median(ms), statistics.median(host)


def flame_build():
    import cupy as cp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flux_random import random_flux
    t0 = time.perf_counter()
    model = random_flux("flux-dev")  # N(0, 0.02) weights drawn on the GPU, QK-norm scales 1
    cp.cuda.Device().synchronize()
    log("flame_build_s", round(time.perf_counter() - t0, 1))
    log("flame_params", sum(p.numel() for p in model.parameters()))
    return model


def flame_inputs(size, seed=1):
    import flame_core as flame
    from flame_models.flux import sampling as S
    g = flame.Generator("cuda").manual_seed(seed)
    tokens = (size // 16) ** 2

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
    return dict(img=rnd(1, tokens, 64), img_ids=S.image_ids(size, size, device="cuda"), txt=rnd(1, T5_LEN, 4096),
                txt_ids=S.text_ids(T5_LEN, device="cuda"), y=rnd(1, 768),
                timesteps=flame.tensor([0.62], dtype=flame.bfloat16, device="cuda"),
                guidance=flame.tensor([3.5], dtype=flame.bfloat16, device="cuda"))


def flame_part(sizes, repeats, warmup):
    import flame_core as flame
    import flame_core.memory as fmem
    model = flame_build()
    log("flame_weights_GiB", gib(fmem.memory_allocated()))
    with flame.no_grad():
        for size in sizes + sizes[:1]:  # the first size again at the end: is the first figure a warm-up effect?
            tag = f"{size}" if f"flame_fwd_{size}_ms" not in R else f"{size}_again"
            args = flame_inputs(size)
            out = model(**args)
            assert out.shape == (1, (size // 16) ** 2, 64)
            o = out.float().numpy()
            assert np.isfinite(o).all() and np.abs(o).mean() > 0, "degenerate output"
            del out
            fmem.reset_peak_memory_stats()
            ms, host = cuda_time(lambda: model(**args), repeats, warmup)
            log(f"flame_fwd_{tag}_ms", round(ms, 1))
            log(f"flame_fwd_{tag}_host_ms", round(host, 1))
            log(f"flame_fwd_{tag}_peak_GiB", round(fmem.max_memory_allocated() / 2 ** 30, 3))
            if tag == f"{size}":  # the same forward replayed as a CUDA graph (as the sampler runs it)
                keys = ("img", "txt", "y", "timesteps", "guidance")
                fwd = flame.cuda.graphed(lambda *a: model(**dict(args, **dict(zip(keys, a)))), warmup=1)
                call = (lambda: fwd(*(args[k] for k in keys)))
                call()  # eager warm-up
                fmem.reset_peak_memory_stats()
                call()  # the capture: every buffer of the graph is allocated (and freed) once, as in eager mode
                log(f"flame_fwd_{tag}_graph_capture_peak_allocated_GiB",
                    round(fmem.max_memory_allocated() / 2 ** 30, 3))
                fmem.reset_peak_memory_stats()
                ms_g, host_g = cuda_time(call, repeats, warmup)
                log(f"flame_fwd_{tag}_graph_ms", round(ms_g, 1))
                log(f"flame_fwd_{tag}_graph_host_ms", round(host_g, 1))
                log(f"flame_fwd_{tag}_graph_peak_reserved_GiB", round(fmem.max_memory_reserved() / 2 ** 30, 3))
                fwd.reset()
                del fwd, call
            before = fmem.memory_stats()
            model(**args)
            after = fmem.memory_stats()
            log(f"flame_fwd_{tag}_pool_per_forward", {k: after[k] - before[k] for k in (
                "num_alloc", "cache_misses", "num_device_alloc", "num_device_free", "num_splits", "num_merges")})
        for size in sizes:
            flame_breakdown(model, size, repeats, warmup)
        flame_profile(model, sizes[0])
    del model
    gc.collect()
    fmem.empty_cache()


def flame_profile(model, size):
    """Host-side profile of one forward (where the launch time goes), to $OUT/flux_flame_profile.txt."""
    import cProfile
    import io
    import pstats
    import cupy as cp
    args = flame_inputs(size)
    model(**args)
    cp.cuda.Device().synchronize()
    prof = cProfile.Profile()
    prof.enable()
    model(**args)
    prof.disable()
    cp.cuda.Device().synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    text = buf.getvalue()
    with open(os.path.join(os.environ.get("OUT", "."), "flux_flame_profile.txt"), "w") as f:
        f.write(text)
    print("\n".join(text.splitlines()[:30]), flush=True)


def flame_breakdown(model, size, repeats, warmup):
    """One double and one single block, each step of a single block, their GEMMs and attention alone."""
    import cupy as cp
    import flame_core as flame
    from flame_models.flux import ops, sampling as S
    from flame_models.flux.layers import split_heads
    n_img = (size // 16) ** 2
    L, H, M = n_img + T5_LEN, 3072, 12288
    g = flame.Generator("cuda").manual_seed(7)

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
    img, txt, vec = rnd(1, n_img, H), rnd(1, T5_LEN, H), rnd(1, H)
    ids = flame.cat((S.text_ids(T5_LEN, device="cuda"), S.image_ids(size, size, device="cuda")), dim=1)
    pe = ops.rope_rows(model.pe_embedder(ids), 1)
    x = flame.cat((txt, img), dim=1)
    db, sb = model.double_blocks[0], model.single_blocks[0]

    def t(fn):  # (as launched, GPU alone, host launch time)
        ms, host = cuda_time(fn, repeats, warmup)
        return round(ms, 3), round(cuda_time(fn, repeats, 1, gpu_only=True)[0], 3), round(host, 3)
    log(f"flame_double_block_{size}_ms_gpu_host", t(lambda: db(img, txt, vec, pe)))
    log(f"flame_single_block_{size}_ms_gpu_host", t(lambda: sb(x, vec, pe)))
    # the single block step by step
    mod, _ = sb.modulation(vec)
    xm = ops.norm_modulate(x, mod.shift, mod.scale)
    h = sb.linear1(xm)
    q, k, v = split_heads(h[..., :3 * H], 24, sb.norm)
    attn = ops.attention(q, k, v, pe)
    mlp = h[..., 3 * H:].contiguous()
    act = ops.gelu_tanh(mlp)
    cat = flame.cat((attn, act), dim=2)
    out = sb.linear2(cat)
    steps = {
        "modulation": lambda: sb.modulation(vec),
        "norm_modulate": lambda: ops.norm_modulate(x, mod.shift, mod.scale),
        "linear1": lambda: sb.linear1(xm),
        "split_heads_qk_norm": lambda: split_heads(h[..., :3 * H], 24, sb.norm),
        "rope_q_and_k": lambda: (ops.rope(q, pe), ops.rope(k, pe)),
        "sdpa": lambda: ops.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "mlp_contiguous": lambda: h[..., 3 * H:].contiguous(),
        "gelu": lambda: ops.gelu_tanh(mlp),
        "cat": lambda: flame.cat((attn, act), dim=2),
        "linear2": lambda: sb.linear2(cat),
        "gated_residual": lambda: ops.gated_residual(x, mod.gate, out),
    }
    log(f"flame_single_block_{size}_steps_ms_gpu_host", {name: t(fn) for name, fn in steps.items()})
    a = cp.asarray(xm._data.reshape(L, H))
    w1, w2 = sb.linear1.weight._data, sb.linear2.weight._data
    c2 = cp.asarray(cat._data.reshape(L, H + M))
    log(f"flame_single_block_{size}_bare_gemms_ms_gpu_host", t(lambda: (cp.matmul(a, w1.T), cp.matmul(c2, w2.T))))


# ----------------------------------------------------------------------------- diffusers (the peer)
def diffusers_part(sizes, repeats, warmup):
    import torch
    from diffusers import FluxTransformer2DModel
    import diffusers
    log("diffusers_version", diffusers.__version__)
    log("torch_version", torch.__version__)
    # as shared/peers/flux_peer.py: cuDNN's SDPA backend crashes on this image, flash / efficient are used
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                       pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    torch.cuda.synchronize()
    log("diffusers_build_s", round(time.perf_counter() - t0, 1))
    log("diffusers_params", sum(p.numel() for p in model.parameters()))
    log("diffusers_weights_GiB", gib(torch.cuda.memory_allocated()))

    busy = []  # made on first use, after the peak-memory figures

    def t_time(fn, gpu_only=False):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if gpu_only:  # as cuda_time: GPU time alone
                if not busy:
                    busy.append(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16))
                for _ in range(4):
                    torch.matmul(busy[0], busy[0])
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    def inputs(size):
        tokens, side = (size // 16) ** 2, size // 16
        img_ids = torch.zeros(side, side, 3, device="cuda")
        img_ids[..., 1] = torch.arange(side, device="cuda")[:, None]
        img_ids[..., 2] = torch.arange(side, device="cuda")[None, :]
        return dict(hidden_states=torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16),
                    encoder_hidden_states=torch.randn(1, T5_LEN, 4096, device="cuda", dtype=torch.bfloat16),
                    pooled_projections=torch.randn(1, 768, device="cuda", dtype=torch.bfloat16),
                    timestep=torch.full((1,), 0.62, device="cuda", dtype=torch.bfloat16),
                    img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(T5_LEN, 3, device="cuda"),
                    guidance=torch.full((1,), 3.5, device="cuda", dtype=torch.bfloat16), return_dict=False)

    def measure(tag):
        with torch.no_grad():
            for size in sizes:
                kw = inputs(size)
                torch.cuda.reset_peak_memory_stats()
                ms = t_time(lambda: model(**kw))
                log(f"{tag}_fwd_{size}_ms", round(ms, 1))
                log(f"{tag}_fwd_{size}_peak_GiB", round(torch.cuda.max_memory_allocated() / 2 ** 30, 3))

    measure("diffusers")
    with torch.no_grad():  # the same per-block breakdown
        for size in sizes:
            kw = inputs(size)
            n_img = (size // 16) ** 2
            img = torch.randn(1, n_img, 3072, device="cuda", dtype=torch.bfloat16)
            txt = torch.randn(1, T5_LEN, 3072, device="cuda", dtype=torch.bfloat16)
            temb = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
            rot = model.pos_embed(torch.cat((kw["txt_ids"], kw["img_ids"]), dim=0))
            db, sb = model.transformer_blocks[0], model.single_transformer_blocks[0]
            for name, blk in (("double", db), ("single", sb)):
                fn = (lambda b: lambda: b(img, txt, temb, image_rotary_emb=rot))(blk)
                log(f"diffusers_{name}_block_{size}_ms_gpu", (round(t_time(fn), 3), round(t_time(fn, True), 3)))
            q = torch.randn(1, 24, n_img + T5_LEN, 128, device="cuda", dtype=torch.bfloat16)
            log(f"torch_sdpa_{size}_ms_gpu", (round(t_time(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)), 3), round(t_time(
                    lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), True), 3)))
    return model


def diffusers_cudnn(model, sizes, repeats, warmup):
    """Extra figure: diffusers with torch's cuDNN SDPA backend on (the peer turned it off; forward-only may work)."""
    import torch
    torch.backends.cuda.enable_cudnn_sdp(True)
    with torch.no_grad():
        for size in sizes:
            tokens, side = (size // 16) ** 2, size // 16
            kw = dict(hidden_states=torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16),
                      encoder_hidden_states=torch.randn(1, T5_LEN, 4096, device="cuda", dtype=torch.bfloat16),
                      pooled_projections=torch.randn(1, 768, device="cuda", dtype=torch.bfloat16),
                      timestep=torch.full((1,), 0.62, device="cuda", dtype=torch.bfloat16),
                      img_ids=torch.zeros(tokens, 3, device="cuda"), txt_ids=torch.zeros(T5_LEN, 3, device="cuda"),
                      guidance=torch.full((1,), 3.5, device="cuda", dtype=torch.bfloat16), return_dict=False)
            for _ in range(warmup):
                model(**kw)
            torch.cuda.synchronize()
            ts = []
            for _ in range(repeats):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                model(**kw)
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e))
            log(f"diffusers_cudnn_sdpa_fwd_{size}_ms", round(statistics.median(ts), 1))


# ----------------------------------------------------------------------------- report
def table(sizes):
    lines = ["", "Flux-dev forward, bf16, batch 1, T5 512 (median ms; peak GiB incl. weights)",
             f"{'size':>9} | {'FLAME ms':>9} | {'diffusers ms':>12} | {'ratio':>6} | {'FLAME GiB':>9} | "
             f"{'diffusers GiB':>13} | {'ratio':>6}"]
    for s in sizes:
        f, d = R.get(f"flame_fwd_{s}_ms"), R.get(f"diffusers_fwd_{s}_ms")
        fm, dm = R.get(f"flame_fwd_{s}_peak_GiB"), R.get(f"diffusers_fwd_{s}_peak_GiB")
        r = f"{f / d:.3f}" if f and d else "-"
        rm = f"{fm / dm:.3f}" if fm and dm else "-"
        lines.append(f"{f'{s}x{s}':>9} | {f or '-':>9} | {d or '-':>12} | {r:>6} | {fm or '-':>9} | {dm or '-':>13} | "
                     f"{rm:>6}")
        if f"flame_fwd_{s}_graph_ms" in R:
            g = R[f"flame_fwd_{s}_graph_ms"]
            lines.append(f"{'':>9}   FLAME as a CUDA graph (the sampler's mode): {g} ms"
                         + (f" = {g / d:.3f}x diffusers" if d else "")
                         + f", peak allocated {R.get(f'flame_fwd_{s}_graph_capture_peak_allocated_GiB')} GiB (at capture)"
                         + f", reserved {R.get(f'flame_fwd_{s}_graph_peak_reserved_GiB')} GiB")
        if f"flame_fwd_{s}_again_ms" in R:
            lines.append(f"{'':>9}   FLAME {s}x{s} measured again after the other sizes: {R[f'flame_fwd_{s}_again_ms']} ms")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-diffusers", action="store_true")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    out = os.path.join(os.environ.get("OUT", "."), "flux_bench.json")
    failed = False
    section("FLAME")
    try:
        flame_part(sizes, a.repeats, a.warmup)
    except Exception:
        traceback.print_exc()
        failed = True
    model = None
    if not a.skip_diffusers:
        section("diffusers")
        try:
            model = diffusers_part(sizes, a.repeats, a.warmup)
        except Exception:
            traceback.print_exc()
            failed = True
    json.dump(R, open(out, "w"), indent=1)
    if model is not None:
        section("diffusers with cuDNN SDPA (extra)")
        try:
            diffusers_cudnn(model, sizes, a.repeats, a.warmup)
        except Exception:
            traceback.print_exc()
        json.dump(R, open(out, "w"), indent=1)
    print(table(sizes), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
