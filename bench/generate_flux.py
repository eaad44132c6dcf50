"""Flux-dev text-to-image at the released size under a memory budget: `flame_models.generate.generate` on random
weights written as the files ComfyUI users have (flux1-dev.safetensors in BFL layout, ae.safetensors,
clip_l.safetensors, t5xxl_fp16.safetensors; tokenizers: the packaged vocabularies), each stage's time and peak.

    PYTHONPATH=$PWD python3 bench/generate_flux.py --max-gpu-memory 12GiB --fp8            # 1024^2, 20 steps
    PYTHONPATH=$PWD python3 bench/generate_flux.py --tiny                                   # cpu smoke test

The random files (about 36 GB at the released size) are written once into --folder (default $TMPDIR/flux_random)
from a pool of Gaussian values, each tensor a scaled slice of it (std 1/sqrt(fan_in) for weights, 1 for norm
scales, 0 for biases): the numbers are meaningless, the sizes, dtypes and names are the real ones. Peaks: FLAME's
pool (max_memory_reserved per stage) and, on cuda, the driver's view (total - free, polled every 2 ms from a thread,
CUDA context included). Writes $OUT/generate_bench.json (or ./generate_bench.json) and prints a table last. No
diffusers run here: diffusers' FluxPipeline has no budgeted mode to compare with (its offloads are per model or per
layer, not to a byte budget).
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

GiB = 2 ** 30


class Pool:
    """Tensors as views of one buffer of Gaussian values (bfloat16), scaled copies cached per scale."""

    def __init__(self, n, seed=0):
        import ml_dtypes
        self.bf16 = ml_dtypes.bfloat16
        self.base = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
        self.scaled = {}
        self.rng = np.random.default_rng(seed + 1)

    def tensor(self, shape, scale):
        n = int(np.prod(shape))
        if scale == 0:
            return np.zeros(shape, self.bf16)
        if scale == 1.0 and len(shape) == 1:
            return np.ones(shape, self.bf16)
        buf = self.scaled.get(scale)
        if buf is None:
            buf = self.scaled[scale] = (self.base * scale).astype(self.bf16)
        if n > buf.size:
            raise ValueError(f"a tensor of {n} values is larger than the pool ({buf.size})")
        off = int(self.rng.integers(0, buf.size - n + 1))
        return buf[off:off + n].reshape(shape)


def _fill(shapes, pool):
    out = {}
    for k, s in shapes.items():
        if k.endswith(("norm.weight", "layer_norm.weight", "_norm.scale", "norm1.weight", "norm2.weight",
                       "final_layer_norm.weight")) or \
                (len(s) == 1 and "norm" in k and k.endswith((".weight", "scale"))):
            out[k] = pool.tensor(s, 1.0)
        elif k.endswith("bias") or len(s) == 1:
            out[k] = pool.tensor(s, 0)
        else:
            out[k] = pool.tensor(s, float(1.0 / np.sqrt(s[-1])))
    return out


def clip_l_shapes(width=768, layers=12, vocab=49408, inter=3072):
    s = {"text_model.embeddings.token_embedding.weight": (vocab, width),
         "text_model.embeddings.position_embedding.weight": (77, width),
         "text_model.final_layer_norm.weight": (width,), "text_model.final_layer_norm.bias": (width,)}
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[p + f"self_attn.{proj}.weight"], s[p + f"self_attn.{proj}.bias"] = (width, width), (width,)
        for ln in ("layer_norm1", "layer_norm2"):
            s[p + f"{ln}.weight"], s[p + f"{ln}.bias"] = (width,), (width,)
        s[p + "mlp.fc1.weight"], s[p + "mlp.fc1.bias"] = (inter, width), (inter,)
        s[p + "mlp.fc2.weight"], s[p + "mlp.fc2.bias"] = (width, inter), (width,)
    return s


def t5_shapes(d=4096, layers=24, heads=64, d_kv=64, d_ff=10240, vocab=32128):
    inner = heads * d_kv
    s = {"shared.weight": (vocab, d), "encoder.final_layer_norm.weight": (d,),
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (32, heads)}
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        for x in "qkv":
            s[p + f"0.SelfAttention.{x}.weight"] = (inner, d)
        s[p + "0.SelfAttention.o.weight"] = (d, inner)
        s[p + "0.layer_norm.weight"] = (d,)
        s[p + "1.DenseReluDense.wi_0.weight"] = (d_ff, d)
        s[p + "1.DenseReluDense.wi_1.weight"] = (d_ff, d)
        s[p + "1.DenseReluDense.wo.weight"] = (d, d_ff)
        s[p + "1.layer_norm.weight"] = (d,)
    return s


def write_random_model(folder, tiny):
    """The four files (skipped when present); returns their paths."""
    import flame_core as flame
    from flame_core.io import save_file
    from flame_models.flux.keys import bfl_shapes
    from flame_models.flux.params import configs
    from flame_models.flux.tiny import TINY_VAE
    from flame_models.vae import AutoencoderKL, save_vae
    os.makedirs(folder, exist_ok=True)
    paths = {k: os.path.join(folder, n) for k, n in (("transformer", "flux1-dev.safetensors"),
                                                     ("vae", "ae.safetensors"), ("clip_l", "clip_l.safetensors"),
                                                     ("t5", "t5xxl_fp16.safetensors"))}
    pool = Pool(2 ** 25 if tiny else 2 ** 28)
    params = configs["flux-tiny"].replace(vec_in_dim=512, context_in_dim=64) if tiny else configs["flux-dev"]
    # tiny: CLIP width 512 (a released width: its activation is known), T5 width 64, the tiny VAE
    parts = {"transformer": lambda: bfl_shapes(params),
             "clip_l": lambda: clip_l_shapes(512, 2, 49408, 128) if tiny else clip_l_shapes(),
             "t5": lambda: t5_shapes(64, 2, 4, 16, 96) if tiny else t5_shapes()}
    for part, shapes in parts.items():
        if not os.path.exists(paths[part]):
            t0 = time.perf_counter()
            save_file(_fill(shapes(), pool), paths[part])
            print(f"wrote {paths[part]} ({os.path.getsize(paths[part]) / GiB:.2f} GiB, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
    if not os.path.exists(paths["vae"]):
        vae = AutoencoderKL(TINY_VAE if tiny else "flux", dtype=flame.bfloat16, device="cpu")
        save_vae(vae, paths["vae"], layout="ldm")
    return paths


class DriverPeak:
    """Polls the device's used memory (total - free) from a thread: what nvidia-smi would show at its worst."""

    def __init__(self, device):
        self.device, self.peak, self._stop = device, 0, threading.Event()
        self.cp = None
        if device.type == "cuda":
            from flame_core import backend
            self.cp = backend.cupy

    def _run(self):
        with self.cp.cuda.Device(self.device.index or 0):
            while not self._stop.is_set():
                free, total = self.cp.cuda.runtime.memGetInfo()
                self.peak = max(self.peak, total - free)
                time.sleep(0.002)

    def __enter__(self):
        if self.cp is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.cp is not None:
            self.thread.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "flux_random"))
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on the cpu (smoke test)")
    ap.add_argument("--max-gpu-memory", default=None)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-images", type=int, default=2)
    args = ap.parse_args()
    import flame_core as flame
    from flame_models.generate import generate
    folder = args.folder + ("_tiny" if args.tiny else "")
    paths = write_random_model(folder, args.tiny)
    device = flame.device("cpu" if args.tiny else ("cuda" if flame.cuda_is_available() else "cpu"))
    if args.tiny:
        args.width, args.height, args.steps = min(args.width, 64), min(args.height, 64), min(args.steps, 3)
    stats = {}
    t0 = time.perf_counter()
    with DriverPeak(device) as driver:
        generate(paths["transformer"], ["a photo of a cat on a sofa", "a city street at night"][:args.num_images],
                 vae=paths["vae"], clip_l=paths["clip_l"], t5=paths["t5"], width=args.width, height=args.height,
                 steps=args.steps, seed=0, device=device, fp8=args.fp8, max_gpu_memory=args.max_gpu_memory,
                 output=os.path.join(folder, "images"), stats=stats)
    total = time.perf_counter() - t0
    result = {"device": str(device), "budget": args.max_gpu_memory, "fp8": args.fp8,
              "size": f"{args.width}x{args.height}", "steps": args.steps, "images": args.num_images,
              "seconds_total": round(total, 2), "driver_peak_gib": round(driver.peak / GiB, 3) if driver.cp else None,
              "stages": {k: {"seconds": v["seconds"], "pool_peak_gib": round(v["peak_bytes"] / GiB, 3)}
                         for k, v in stats.items()}}
    out = os.path.join(os.environ.get("OUT") or "out", "generate_bench.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nFlux {'tiny' if args.tiny else 'dev'} generate on {device}, {result['size']}, {args.steps} steps, "
          f"{args.num_images} image(s), budget {args.max_gpu_memory}, fp8 {args.fp8}")
    print(f"{'stage':<16}{'seconds':>10}{'pool peak GiB':>16}")
    for k, v in result["stages"].items():
        print(f"{k:<16}{v['seconds']:>10.1f}{v['pool_peak_gib']:>16.3f}")
    print(f"{'total':<16}{total:>10.1f}" + (f"{'driver peak':>16} {result['driver_peak_gib']:.3f} GiB"
                                              if driver.cp else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
