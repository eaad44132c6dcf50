"""Text encoders: FLAME's CLIP-L, CLIP-G (with projection) and T5-v1.1-XXL side by side with transformers'
CLIPTextModel / CLIPTextModelWithProjection / T5EncoderModel in the same process, as shared/PEERS.md measures them:
random init at the real sizes, bf16 weights, no grad, batch 1; CLIP 77 tokens, T5 512 tokens with all hidden states.

Per encoder: transformers' model is built on the GPU (bf16, its default sdpa attention), timed, its outputs kept on
the host, saved with save_pretrained and dropped. FLAME loads that folder with load_clip / load_t5 (bf16) and is
timed eagerly and through GraphedEncoder (CUDA graph replay); T5 also with fp8 storage (quantize="fp8") and with
fp8 + streamed blocks (stream=True). Time: wall clock of one call between device synchronisations, median of
--repeats after warm-up. Peak: max_memory_allocated of each framework's allocator over the timed calls (weights
included), reset right before them. Error: rms(FLAME - transformers) / rms(transformers) of the outputs.

    PYTHONPATH=$PWD python3 bench/text_encoders.py [--encoders clip-l,clip-g,t5] [--repeats 20]
    PYTHONPATH=$PWD python3 bench/text_encoders.py --tiny        # smoke test on cpu: tiny configs, float32
Writes $OUT/text_encoders_bench.json (or ./text_encoders_bench.json) and prints a table last.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

# bench/ (this script's folder, first on sys.path) holds a kernels.py that transformers would import as the
# `kernels` package when it probes for it
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

R = {}
ROWS = []


def log(key, value):
    R[key] = value
    print(f"{key}: {value}", flush=True)


def gib(nbytes):
    return round(nbytes / 2 ** 30, 3)


SPECS = {  # transformers config kwargs, tokens, what to compare
    "clip-l": dict(kind="clip", cls="CLIPTextModel", tokens=77, hidden=False,
                   config=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                               num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                               projection_dim=768, bos_token_id=0, eos_token_id=2, pad_token_id=1)),
    "clip-g": dict(kind="clip", cls="CLIPTextModelWithProjection", tokens=77, hidden=False,
                   config=dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                               num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
                               projection_dim=1280, bos_token_id=0, eos_token_id=2, pad_token_id=1)),
    "t5": dict(kind="t5", cls="T5EncoderModel", tokens=512, hidden=True,
               config=dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                           feed_forward_proj="gated-gelu", dropout_rate=0.0)),
}
TINY = {"clip-l": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                       projection_dim=64),
        "clip-g": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                       projection_dim=128),
        "t5": dict(d_model=64, d_ff=96, num_layers=2, num_heads=2, d_kv=32, vocab_size=1000)}


def token_ids(spec, rng):
    n = spec["tokens"]
    if spec["kind"] == "t5":
        return rng.integers(2, 32000, (1, n)).astype(np.int64)
    ids = np.full((1, n), 49407, np.int64)  # CLIP-L style: BOS, words, EOS, padded with EOS
    ids[0, 0] = 49406
    ids[0, 1:20] = rng.integers(300, 40000, 19)
    return ids


# ----------------------------------------------------------------------------- timing
class Device:
    def __init__(self, name):
        self.name = name
        self.cuda = name == "cuda"

    def sync(self):
        if self.cuda:
            import cupy as cp
            import torch
            torch.cuda.synchronize()
            cp.cuda.Device().synchronize()


def timed(dev, fn, repeats, warmup=3):
    for _ in range(warmup):
        out = fn()
        del out
    dev.sync()
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        dev.sync()
        ms.append((time.perf_counter() - t) * 1e3)
        del out
    return round(statistics.median(ms), 3)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(((got - want) ** 2).mean() / max((want ** 2).mean(), 1e-30)))


# ----------------------------------------------------------------------------- one encoder
def peer(name, spec, dev, args, ids, folder):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg_cls = transformers.T5Config if spec["kind"] == "t5" else transformers.CLIPTextConfig
    config = cfg_cls(**spec["config"])
    cls = getattr(transformers, spec["cls"])
    dtype = torch.float32 if args.tiny else torch.bfloat16
    with torch.device(dev.name):
        model = cls._from_config(config, dtype=dtype).eval()
    x = torch.from_numpy(ids).to(dev.name)

    def call():
        with torch.no_grad(), torch.autocast(dev.name, dtype=dtype, enabled=not args.tiny):
            return model(input_ids=x, output_hidden_states=spec["hidden"])
    ref = call()
    keep = {k: ref[k].float().cpu().numpy() for k in ("last_hidden_state", "pooler_output", "text_embeds")
            if k in ref and ref[k] is not None}
    if spec["hidden"]:
        keep["hidden_states.-2"] = ref.hidden_states[-2].float().cpu().numpy()
    del ref
    if dev.cuda:
        torch.cuda.reset_peak_memory_stats()
    ms = timed(dev, call, args.repeats)
    peak = gib(torch.cuda.max_memory_allocated()) if dev.cuda else None
    ROWS.append((name, "transformers", ms, peak, None))
    log(f"{name}_transformers_ms", ms)
    log(f"{name}_transformers_peak_GiB", peak)
    model.save_pretrained(folder)
    del model, x
    gc.collect()
    if dev.cuda:
        torch.cuda.empty_cache()
    return keep


def flame_runs(name, spec, dev, args, ids, folder, ref):
    import flame_core as flame
    import flame_core.memory as fmem
    from flame_models.text_encoders import GraphedEncoder, load_clip, load_t5
    dtype = "float32" if args.tiny else "bfloat16"
    variants = [("eager", {}, False), ("graphed", {}, True)]
    if spec["kind"] == "t5":
        variants += [("fp8", {"quantize": "fp8"}, False), ("fp8_streamed", {"quantize": "fp8", "stream": True},
                                                           False)]
    x = flame.tensor(ids, device=dev.name)
    for tag, kw, graph in variants:
        gc.collect()
        if dev.cuda:
            fmem.empty_cache()
        t0 = time.perf_counter()
        load = load_t5 if spec["kind"] == "t5" else load_clip
        model = load(folder, dtype=dtype, device=dev.name, **kw)
        log(f"{name}_flame_{tag}_load_s", round(time.perf_counter() - t0, 1))
        run = GraphedEncoder(model) if graph else model

        def call():
            with flame.no_grad():
                return run(x, output_hidden_states=spec["hidden"])
        out = call()
        errs = {k: rel_err(out[k].float().numpy(), v) for k, v in ref.items() if k in out.keys()}
        if "hidden_states.-2" in ref:
            errs["hidden_states.-2"] = rel_err(out.hidden_states[-2].float().numpy(), ref["hidden_states.-2"])
        del out
        if dev.cuda:
            fmem.reset_peak_memory_stats()
        ms = timed(dev, call, args.repeats)
        peak = gib(fmem.max_memory_allocated()) if dev.cuda else None
        worst = max(errs.values()) if errs else None
        ROWS.append((name, f"flame {tag}", ms, peak, worst))
        log(f"{name}_flame_{tag}_ms", ms)
        log(f"{name}_flame_{tag}_peak_GiB", peak)
        log(f"{name}_flame_{tag}_rel_err", {k: round(v, 5) for k, v in errs.items()})
        if graph:
            run.reset()
        del model, run, call
    del x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoders", default="clip-l,clip-g,t5")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny configs in float32 on cpu (a smoke test)")
    args = ap.parse_args()
    dev = Device("cpu" if args.tiny else "cuda")
    if args.tiny:
        for k, v in TINY.items():
            SPECS[k]["config"].update(v)
        SPECS["t5"]["tokens"] = 64
        args.repeats = min(args.repeats, 3)
    rng = np.random.default_rng(0)
    for name in args.encoders.split(","):
        spec = SPECS[name]
        print(f"\n== {name} ({time.strftime('%X')})", flush=True)
        ids = token_ids(spec, rng)
        if args.tiny:
            ids = ids % spec["config"]["vocab_size"]
        with tempfile.TemporaryDirectory(prefix=f"te_{name}_") as folder:
            try:
                ref = peer(name, spec, dev, args, ids, folder)
                flame_runs(name, spec, dev, args, ids, folder, ref)
            except Exception:  # noqa: BLE001 - report and go on with the next encoder
                traceback.print_exc()
                log(f"{name}_error", traceback.format_exc().splitlines()[-1])
    out = os.path.join(os.environ.get("OUT", "."), "text_encoders_bench.json")
    with open(out, "w") as f:
        json.dump(R, f, indent=2)
    print(f"\nwrote {out}\n")
    print(f"{'encoder':8} {'run':22} {'ms':>9} {'peak GiB':>9} {'rel err':>9}")
    for name, run, ms, peak, err in ROWS:
        print(f"{name:8} {run:22} {ms:9.3f} {peak if peak is not None else '-':>9} "
              f"{'' if err is None else f'{err:.2e}':>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
