"""Host memory of loading a Flux-width transformer for fp8 storage (what `generate --fp8` does before the blocks go
to the GPU): the peak anonymous memory of a fresh process (RssAnon, sampled every ms), above its size after the
imports, for

    bf16 then quantise     the load in bfloat16, then quantize_linear_weights_ on the blocks (FLAME before
                           checkpoint_io.fp8_on_read: the whole model in bfloat16 on the host first)
    fp8 on read (bf16)     load_for_sampling(fp8=True) from the bfloat16 file: each block weight quantised as read
    fp8 on read (fp8 file) the same from ComfyUI-style scaled fp8 (e4m3fn + per-tensor scale_weight): bytes kept

The files hold random weights at Flux's width (`--width`, default 3072, MLP 4x) with `--double` / `--single` blocks
(Flux-dev: 19 / 38, 23.8 GB in bfloat16; the default 2 / 4 is 2.6 GB), written once under --dir. The figures are
CPU-side and need no GPU.
With --device cuda the blocks are quantised on the GPU (the generate --fp8 path there) and the device pool's peak
is reported too.
Usage: PYTHONPATH=$PWD python3 bench/fp8_load_memory.py [--double 2 --single 4 --width 3072 --device cuda]"""
import argparse
import json
import os
import resource
import subprocess
import sys
import threading

import common

STACKS = ["double_blocks", "single_blocks"]


def _anon():
    """This process's anonymous resident memory (RssAnon: not the safetensors files' mapped pages, which the
    resident set also counts and the kernel may drop at any time), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status")


class _Peak(threading.Thread):
    """The highest RssAnon seen, sampled every millisecond while it runs (the kernel keeps no anonymous peak)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self._done = _anon(), threading.Event()

    def run(self):
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _anon())

    def stop(self):
        self._done.set()
        self.join()
        self.peak = max(self.peak, _anon())
        return self.peak


def _write(args):
    """The bfloat16 and the scaled-fp8 files (random weights, BFL names), if not there yet."""
    import ml_dtypes
    import numpy as np

    from flame_core import io
    from flame_models.flux import flux_params
    from flame_models.flux import keys as K
    os.makedirs(args.dir, exist_ok=True)
    p = flux_params("flux-dev").replace(depth=args.double, depth_single_blocks=args.single, hidden_size=args.width,
                                        num_heads=args.width // 128)
    tag = f"{args.double}_{args.single}_{args.width}"
    bf16 = os.path.join(args.dir, f"flux_{tag}_bf16.safetensors")
    fp8 = os.path.join(args.dir, f"flux_{tag}_fp8_scaled.safetensors")
    if os.path.exists(bf16) and os.path.exists(fp8):
        return bf16, fp8
    rng = np.random.default_rng(0)
    state, scaled = {}, {"scaled_fp8": np.zeros(0, ml_dtypes.float8_e4m3fn)}
    for k, shape in K.bfl_shapes(p).items():
        a = rng.standard_normal(shape, dtype=np.float32) * 0.02
        state[k] = a.astype(ml_dtypes.bfloat16)
        if k.startswith(tuple(STACKS)) and k.endswith(".weight") and len(shape) == 2:
            s = np.float32(np.abs(a).max() / 448.0)
            scaled[k] = (a / s).astype(ml_dtypes.float8_e4m3fn)
            scaled[k[:-len("weight")] + "scale_weight"] = np.array(s, np.float32)
        else:
            scaled[k] = state[k]
        del a
    io.save_file(state, bf16)
    del state
    io.save_file(scaled, fp8)
    return bf16, fp8


def _child(case, path, device):
    """One case in this (fresh) process: prints {"base", "peak", "after": anonymous bytes, "fp8_layers": n,
    "resident_peak": the resident set's peak, mapped file pages included, "device_peak": the device pool's peak
    (cuda)}. The case before fp8_on_read is what load_for_sampling did: the model read into host memory in bf16,
    then each block moved to the device and quantised there."""
    import flame_core as flame
    from flame_core import memory
    from flame_models.flux import load_flux
    from flame_models.pipeline import load_for_sampling
    from flame_nn.offload import is_fp8_linear, quantize_linear_weights_
    if device != "cpu":
        memory.reset_peak_memory_stats(device)
    base = _anon()
    sampler = _Peak()
    sampler.start()

    def load(dev):
        return load_flux(path, dtype=flame.bfloat16, device=dev)
    if case == "bf16 then quantise":
        model = load("cpu").requires_grad_(False)
        for s in STACKS:
            for block in model.get_submodule(s):
                block.to(device)
                quantize_linear_weights_(block)
    else:
        model = load_for_sampling(load, path, [], STACKS, device, fp8=True)
    peak = sampler.stop()
    n = sum(is_fp8_linear(m) for m in model.modules())
    print(json.dumps({"base": base, "peak": peak, "fp8_layers": n, "after": _anon(),
                      "resident_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "device_peak": memory.max_memory_allocated(device) if device != "cpu" else None}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--width", type=int, default=3072, help="hidden size, a multiple of 128 (Flux: 3072)")
    ap.add_argument("--dir", default="/tmp/fp8_load_memory")
    ap.add_argument("--device", default="cpu", help="where the blocks go (cpu, or cuda: quantised there)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(*args.child)
    if args.width % 128 or args.width <= 0:
        ap.error(f"--width {args.width}: a positive multiple of 128 (Flux's head dim)")
    res = common.Results("fp8_load_memory")
    bf16, fp8 = _write(args)
    res.log("files", {"bf16_bytes": os.path.getsize(bf16), "fp8_bytes": os.path.getsize(fp8),
                      "double": args.double, "single": args.single})
    rows = []
    for case, path in (("bf16 then quantise", bf16), ("fp8 on read (bf16 file)", bf16),
                       ("fp8 on read (fp8 file)", fp8)):
        out = subprocess.run([sys.executable, __file__, "--child", case, path, args.device], capture_output=True,
                             text=True,
                             check=True, env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "")))
        r = json.loads(out.stdout.strip().splitlines()[-1])
        res.log(case, r)
        gib = 2.0 ** 30
        dpeak = r["device_peak"]
        rows.append([case, f"{(r['peak'] - r['base']) / gib:.2f}", f"{(r['after'] - r['base']) / gib:.2f}",
                     "-" if dpeak is None else f"{dpeak / gib:.2f}", r["fp8_layers"]])
    print(common.table(["case", "anon peak above imports GiB", "held after GiB", "device peak GiB", "fp8 Linears"],
                       rows,
                       title=f"host memory of a fp8 load onto {args.device}, width {args.width}, {args.double} + "
                             f"{args.single} blocks "
                             f"({os.path.getsize(bf16) / 2 ** 30:.2f} GiB in bfloat16)"))
    res.save()
    return res


if __name__ == "__main__":
    main()
