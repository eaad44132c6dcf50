"""The Flux pipeline's parts on the GPU, side by side with what users run today in the same process: the VAE
(diffusers AutoencoderKL: the 16-channel Flux/SD3 VAE and the 4-channel SDXL VAE with quant convs) and the text
encoders (transformers CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel), random init at the real sizes,
bf16 weights, no grad, batch 1, as the PEERS table measures them; then (`run`) a whole Flux-dev LoRA run at 1024^2
with random weights under max_gpu_memory 12GiB through the trainer: cache the latents of 8 images and the text
embeddings of their captions, 20 training steps, 2 sample images, each stage's time and peak.

Components: the peer's model is built on the GPU, timed, its outputs kept, saved (save_pretrained) and dropped;
FLAME loads the same weights from that folder (load_vae / load_clip / load_t5), so both run identical weights and the
relative error of FLAME's output is reported beside its time. Time: CUDA events around one call, median of
--repeats after warm-up. Peak: each framework's allocator peak over the timed calls, weights included (torch
max_memory_allocated; FLAME's pool max_memory_allocated), reset right before them.

    PYTHONPATH=$PWD python3 bench/pipeline.py [vae text run] [--repeats 10] [--tiny] [--text-models clip_l,clip_g]
    PYTHONPATH=$PWD python3 bench/pipeline.py text --cpu --text-models clip_l,clip_g --rounds 7
The eager text encoders are also timed interleaved with the peer (`--rounds`, one call of each per round, the order
flipped every round; wall time ended by a synchronize): their calls are host-bound, and the per-round ratio cancels
the host's drift that separate timings carry (the `eager, interleaved` table).
--tiny: tiny configs in float32 on the cpu (a smoke test of the script). --cpu (the text part): the real sizes in
float32 on the cpu, the eager interleaved comparison only (torch on its default threads). Writes
$OUT/pipeline.json, table last.
"""
import argparse
import gc
import os
import sys
import tempfile
import time

import common
import numpy as np

# bench/ is first on sys.path and holds a kernels.py that transformers would import as the `kernels` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

RES = common.Results("pipeline")
ROWS = []  # (part, peer ms, peer GiB, FLAME ms, FLAME GiB, rel err)
INTERLEAVED = []  # (part, peer ms, FLAME ms, median per-round ratio, min, max): eager text encoders, interleaved
STAGES = []  # (stage, seconds, pool peak GiB, driver peak GiB) of the whole run
ARGS = None

VAE_CFG = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
               up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2)
TEXT = {  # transformers class, config, tokens (the PEERS setup: all hidden states returned)
    "clip_l": ("CLIPTextModel", dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                     num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu"), 77),
    "clip_g": ("CLIPTextModelWithProjection", dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120,
                                                   num_hidden_layers=32, num_attention_heads=20,
                                                   max_position_embeddings=77, hidden_act="gelu",
                                                   projection_dim=1280), 77),
    "t5xxl": ("T5EncoderModel", dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                                     feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False), 512),
}
TINY_TEXT = {"clip_l": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
             "clip_g": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            projection_dim=64),
             "t5xxl": dict(d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32)}


def dev():
    return "cpu" if ARGS.tiny or ARGS.cpu else "cuda"


def sync(lib):
    if dev() == "cuda":
        common.synchronize(lib)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(((got - want) ** 2).mean() / max((want ** 2).mean(), 1e-30)))


def timed(fn, lib):
    """(median ms, peak GiB) of fn() after warm-up; the allocator's peak is reset right before the timed calls."""
    if ARGS.tiny:
        fn()
        t = time.perf_counter()
        fn()
        return round((time.perf_counter() - t) * 1e3, 3), None
    fn()
    if lib == "torch":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        import flame_core.memory as fmem
        common.synchronize()
        fmem.reset_peak_memory_stats()
    ms, _, _ = common.cuda_ms(fn, repeats=ARGS.repeats, warmup=1, lib=lib)
    if lib == "torch":
        import torch
        peak = torch.cuda.max_memory_allocated()
    else:
        import flame_core.memory as fmem
        peak = fmem.max_memory_allocated()
    return round(ms, 3), common.gib(peak, 3)


def free_torch():
    gc.collect()
    if not ARGS.tiny:
        import torch
        torch.cuda.empty_cache()


def free_flame():
    gc.collect()
    if not ARGS.tiny:
        import flame_core.memory as fmem
        fmem.empty_cache()


def interleaved_row(part, peer_fn, flame_fn):
    """The eager calls of both frameworks alternated (--rounds rounds, one call of each per round after one of each
    as warm-up, the order flipped every round; wall time of a call ended by its device synchronize): host-bound calls
    move with the host's speed within a process, and both sides of a round's ratio FLAME / peer run within
    milliseconds of each other. Logged: each side's median ms and the median per-round ratio with its spread."""
    sides = (("torch", peer_fn, []), ("cupy", flame_fn, []))
    for lib, fn, _ in sides:
        fn()
        sync(lib)
    for r in range(ARGS.rounds):
        for lib, fn, acc in (sides if r % 2 == 0 else sides[::-1]):
            t = time.perf_counter()
            fn()
            sync(lib)
            acc.append((time.perf_counter() - t) * 1e3)
    peer_ms, flame_ms = sides[0][2], sides[1][2]
    ratios = sorted(b / a for a, b in zip(peer_ms, flame_ms))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    rec = (part, round(med(peer_ms), 3), round(med(flame_ms), 3), round(med(ratios), 3), round(ratios[0], 3),
           round(ratios[-1], 3))
    INTERLEAVED.append(rec)
    RES.log(f"{part}_interleaved", {"peer_ms": rec[1], "flame_ms": rec[2], "ratio": rec[3], "ratio_min": rec[4],
                                    "ratio_max": rec[5], "rounds": ARGS.rounds})


def row(part, peer, mine, err):
    ROWS.append((part, peer[0], peer[1], mine[0], mine[1], None if err is None else f"{err:.1e}"))
    RES.log(f"{part}_peer", {"ms": peer[0], "peak_GiB": peer[1]})
    RES.log(f"{part}_flame", {"ms": mine[0], "peak_GiB": mine[1], "rel_err": err})


# ----------------------------------------------------------------------------- VAE
def vae_part():
    import torch
    from diffusers import AutoencoderKL as PeerVAE

    import flame_core as flame
    from flame_models.vae import load_vae
    side = 64 if ARGS.tiny else 1024
    tdt = torch.float32 if ARGS.tiny else torch.bfloat16
    fdt = flame.float32 if ARGS.tiny else flame.bfloat16
    for name, zc, quant in (("flux_vae", 16, False), ("sdxl_vae", 4, True)):
        cfg = dict(VAE_CFG, latent_channels=zc, use_quant_conv=quant, use_post_quant_conv=quant)
        if ARGS.tiny:
            cfg.update(block_out_channels=(32, 32, 32, 32), norm_num_groups=8)
        torch.manual_seed(0)
        with torch.device(dev()):
            peer = PeerVAE(**cfg).to(tdt).eval()
        g = torch.Generator(dev()).manual_seed(1)
        x = torch.rand(1, 3, side, side, generator=g, device=dev()).mul(2).sub(1).to(tdt)  # an image in [-1, 1]
        with torch.no_grad():
            z_ref = peer.encode(x).latent_dist.mean
            img_ref = peer.decode(z_ref).sample
            enc = timed(lambda: peer.encode(x).latent_dist.mean, "torch")
            dec = timed(lambda: peer.decode(z_ref).sample, "torch")
        x_np, z_np = x.float().cpu().numpy(), z_ref.float().cpu().numpy()
        want_z, want_img = z_np, img_ref.float().cpu().numpy()
        with tempfile.TemporaryDirectory(prefix="vae_") as folder:
            peer.save_pretrained(folder)
            peer = x = z_ref = img_ref = None  # rebound, not deleted: closures above use the names
            free_torch()
            cfg_kw = {"norm_num_groups": 8} if ARGS.tiny else None
            vae = load_vae(folder, dtype=fdt, device=dev(), config=cfg_kw)
        xf = flame.tensor(x_np, device=dev()).to(fdt)
        zf = flame.tensor(z_np, device=dev()).to(fdt)
        with flame.no_grad():
            err_z = rel_err(vae.encode(xf).float().numpy(), want_z)
            err_img = rel_err(vae.decode(zf).float().numpy(), want_img)
            enc_f = timed(lambda: vae.encode(xf), "cupy")
            dec_f = timed(lambda: vae.decode(zf), "cupy")
        row(f"{name} encode {side}^2", enc, enc_f, err_z)
        row(f"{name} decode {side // 8}^2 latents", dec, dec_f, err_img)
        vae = xf = zf = None  # rebound, not deleted: closures above use the names
        free_flame()


# ----------------------------------------------------------------------------- text encoders
def text_part():
    import torch
    import transformers

    import flame_core as flame
    from flame_models.text_encoders import GraphedEncoder, load_clip, load_t5
    tdt = torch.float32 if ARGS.tiny or ARGS.cpu else torch.bfloat16
    fdt = flame.float32 if ARGS.tiny or ARGS.cpu else flame.bfloat16
    rng = np.random.default_rng(0)
    for name, (cls, cfg, tokens) in ((n, TEXT[n]) for n in ARGS.text_models):
        cfg = dict(cfg, **(TINY_TEXT[name] if ARGS.tiny else {}))
        t5 = name == "t5xxl"
        config = (transformers.T5Config if t5 else transformers.CLIPTextConfig)(**cfg)
        torch.manual_seed(0)
        with torch.device(dev()):
            peer = getattr(transformers, cls)._from_config(config, dtype=tdt).eval()
        if t5:
            ids = rng.integers(2, 32000, (1, tokens)).astype(np.int64)
        else:  # BOS, words, EOS, padded with EOS (CLIP-L's rule)
            ids = np.full((1, tokens), 49407, np.int64)
            ids[0, 0], ids[0, 1:20] = 49406, rng.integers(300, 40000, 19)
        x = torch.from_numpy(ids).to(dev())
        with torch.no_grad():
            out = peer(input_ids=x, output_hidden_states=True)
            want = out.last_hidden_state.float().cpu().numpy()
            del out
            ms = timed(lambda: peer(input_ids=x, output_hidden_states=True), "torch") if not ARGS.cpu else None
        with tempfile.TemporaryDirectory(prefix=f"{name}_") as folder:
            peer.save_pretrained(folder)
            if not ARGS.tiny:   # eager FLAME and the peer interleaved in this process: the per-round ratio
                model = (load_t5 if t5 else load_clip)(folder, dtype=fdt, device=dev())
                xf = flame.tensor(ids, device=dev())
                with flame.no_grad(), torch.no_grad():
                    interleaved_row(f"{name} {tokens} tokens eager",
                                    lambda: peer(input_ids=x, output_hidden_states=True),
                                    lambda: model(xf, output_hidden_states=True))
                if ARGS.cpu:
                    err = rel_err(model(xf, output_hidden_states=True).last_hidden_state.float().numpy(), want)
                    RES.log(f"{name}_cpu_rel_err", err)
                model = xf = None  # rebound, not deleted: closures above use the names
                free_flame()
            peer = x = None  # rebound, not deleted: closures above use the names
            free_torch()
            if ARGS.cpu:   # the interleaved eager rows only (the graphed / fp8 variants are cuda's)
                continue
            variants = [("", {}, False), (" graphed", {}, True)]
            if t5:
                variants += [(" fp8", {"quantize": "fp8"}, False), (" fp8 graphed", {"quantize": "fp8"}, True),
                             (" fp8 streamed", {"quantize": "fp8", "stream": True}, False)]
            xf = flame.tensor(ids, device=dev())
            for tag, kw, graph in variants:
                model = (load_t5 if t5 else load_clip)(folder, dtype=fdt, device=dev(), **kw)
                run = GraphedEncoder(model) if graph and not ARGS.tiny else model
                with flame.no_grad():
                    err = rel_err(run(xf, output_hidden_states=True).last_hidden_state.float().numpy(), want)
                    mine = timed(lambda: run(xf, output_hidden_states=True), "cupy")
                row(f"{name} {tokens} tokens{tag}", ms, mine, err)
                if graph and not ARGS.tiny:
                    run.reset()
                model = run = None  # rebound, not deleted: closures above use the names
                free_flame()


# ----------------------------------------------------------------------------- the whole run
def run_part():
    """A whole Flux-dev LoRA run through the trainer, random weights at the real sizes (model.size flux-dev: the
    transformer's blocks drawn on the GPU one at a time as the streamer packs them; VAE, CLIP-L, T5-XXL random; the
    packaged tokenizers), under max_gpu_memory: 8 images cached, 20 steps, 2 sample images. Each stage's time, pool
    peak and driver-observed peak come from the trainer's stage meter."""
    from flame_models.flux.demo import draw_dataset
    from flame_models.training import Trainer, config_from_dict
    side = 64 if ARGS.tiny else 1024
    work = tempfile.mkdtemp(prefix="pipeline_run_")
    images = draw_dataset(os.path.join(work, "images"), 4, 4, size=side)
    cfg = {"name": "flux_dev_random", "training_folder": os.path.join(work, "runs"), "device": dev(),
           "datasets": [{"folder_path": images, "resolution": side}],
           "model": {"size": "flux-tiny" if ARGS.tiny else "flux-dev", "dtype": "fp32" if ARGS.tiny else "bf16",
                     "quantize": ARGS.fp8},
           "network": {"type": "lora", "linear": 16, "linear_alpha": 16, "target": "attention"},
           "train": {"steps": 20, "batch_size": 1, "gradient_checkpointing": True, "optimizer": "adamw8bit",
                     "dtype": "fp32" if ARGS.tiny else "bf16", "skip_first_sample": True},
           "sample": {"sample_every": 20, "sample_steps": 20, "guidance_scale": 3.5, "width": side, "height": side,
                      "prompts": ["a photo of a cat", "a photo of a dog"]},
           "save": {"save_every": 20}}
    if not ARGS.tiny:
        cfg["max_gpu_memory"] = ARGS.budget
    t0 = time.perf_counter()
    result = Trainer(config_from_dict(cfg, "bench/pipeline.py")).train()
    RES.log("run_seconds", round(time.perf_counter() - t0, 1))
    RES.log("run_budget", None if ARGS.tiny else ARGS.budget)
    for st in result["stages"]:
        RES.log(f"run_stage_{st['stage']}", st)
        STAGES.append((st["stage"], round(st["seconds"], 1), common.gib(st.get("peak_allocated"), 2),
                       common.gib(st.get("device_peak"), 2)))
    RES.log("run_losses", [round(x, 4) for x in result["losses"]])


PARTS = {"vae": vae_part, "text": text_part, "run": run_part}


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", default=list(PARTS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny configs in float32 on the cpu (smoke test)")
    ap.add_argument("--cpu", action="store_true",
                    help="text part: the real sizes in float32 on the cpu, interleaved with transformers (eager)")
    ap.add_argument("--rounds", type=int, default=30,
                    help="rounds of the text encoders' interleaved eager comparison (one call of each per round)")
    ap.add_argument("--budget", default="12GiB", help="max_gpu_memory of the whole run")
    ap.add_argument("--fp8", action="store_true", help="the whole run with fp8 storage of the blocks")
    ap.add_argument("--text-models", default=",".join(TEXT),
                    help=f"the text part's encoders, comma-separated (of {', '.join(TEXT)})")
    ARGS = ap.parse_args()
    ARGS.text_models = [n.strip() for n in ARGS.text_models.split(",") if n.strip()]
    if ARGS.cpu and (set(ARGS.parts) - {"text"} or ARGS.tiny):
        ap.error("--cpu measures the text part alone, at the real sizes (not with --tiny)")
    unknown = [n for n in ARGS.text_models if n not in TEXT]
    if unknown or not ARGS.text_models:
        ap.error(f"--text-models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(TEXT)}")
    failed = common.run_parts(RES, [(p, PARTS[p]) for p in ARGS.parts])
    print(common.table(["part", "peer ms", "peer GiB", "FLAME ms", "FLAME GiB", "ms ratio", "GiB ratio",
                        "rel err"],
                       [(p, a, b, c, d, common.ratio(c, a), common.ratio(d, b), e) for p, a, b, c, d, e in ROWS],
                       title="\nFLAME vs diffusers / transformers (ratio = FLAME / peer; <= 1.0 is better)"))
    if INTERLEAVED:
        print(common.table(["part", "peer ms", "FLAME ms", "ratio (median of rounds)", "min", "max"], INTERLEAVED,
                           title=f"\neager, FLAME and the peer interleaved ({ARGS.rounds} rounds; <= 1.0 is better)"))
    if STAGES:
        print(common.table(["stage", "seconds", "pool peak GiB", "driver peak GiB"], STAGES,
                           title=f"\nwhole Flux-dev run (random weights, max_gpu_memory {ARGS.budget}, "
                                 f"fp8 {ARGS.fp8})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
