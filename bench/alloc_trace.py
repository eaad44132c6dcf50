"""Record the device pool's allocation trace of Flux-dev-size workloads, for tuning the pool offline.

Each trace is a list of ("a", request_bytes, ptr, stream) / ("f", ptr) events in order, with the pool's peak
allocated / reserved seen while recording. Workloads: an inference forward at --size (eager), and a LoRA training
step (forward + backward, checkpointing on and off). Writes $OUT/alloc_traces.json.
Run: PYTHONPATH=$PWD python3 bench/alloc_trace.py [--size 1024]
"""
import argparse
import json
import os
import sys

import flame_core as flame
from flame_core import amp
from flame_core.memory import cuda as mcuda


class Recorder:
    def __init__(self, pool):
        self.pool, self.events = pool, []

    def __call__(self, event, pool, blk):
        if event == "alloc":
            self.events.append(("a", blk.requested, blk.ptr, blk.sub.stream))
        elif event == "free":
            self.events.append(("f", blk.ptr))

    def __enter__(self):
        flame.cuda.synchronize()
        self.pool.empty_cache()
        self.pool.reset_peak()
        self.start_alloc, self.start_reserved = self.pool.allocated, self.pool.reserved
        self.live = [(b.size, b.ptr) for b in self.pool.live_blocks()]
        self.pool.observer = self
        return self

    def __exit__(self, *exc):
        flame.cuda.synchronize()
        self.pool.observer = None
        return False

    def result(self):
        return {"events": self.events, "start_allocated": self.start_alloc, "start_reserved": self.start_reserved,
                "peak_allocated": self.pool.peak_allocated, "peak_reserved": self.pool.peak_reserved,
                "live_at_start": len(self.live)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "alloc_traces.json"))
    a = ap.parse_args()
    import flame_nn
    from flame_nn import adapters as A
    from flame_models.flux import sampling as S
    from flame_models.flux.lora_keys import name_map_for
    from flame_models.flux.params import configs
    p = configs["flux-dev"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flux_random import random_flux
    model = random_flux(p)
    g = flame.Generator("cuda").manual_seed(0)
    model.requires_grad_(False)
    pool = mcuda.pool_for(0)
    tokens = (a.size // 16) ** 2

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
    kw = dict(img=rnd(1, tokens, 64), img_ids=S.image_ids(a.size, a.size, device="cuda"), txt=rnd(1, 512, 4096),
              txt_ids=S.text_ids(512, device="cuda"), y=rnd(1, 768), timesteps=flame.tensor([0.6], device="cuda"),
              guidance=flame.tensor([1.0], device="cuda"))
    traces = {}
    with flame.no_grad():
        model(**kw)
        with Recorder(pool) as r:
            out = model(**kw)
            del out
        traces[f"forward_{a.size}"] = r.result()
    A.inject_adapters(model, ["to_q", "to_k", "to_v", "to_out.0"], "lora", rank=16, alpha=16,
                      name_map=name_map_for(p))
    opt = flame_nn.optim.AdamW(A.adapter_parameters(model), lr=1e-4)
    target = rnd(1, tokens, 64).float()
    for ckpt in (True, False):
        model.enable_gradient_checkpointing(ckpt)

        def step():
            with amp.autocast("cuda", dtype=flame.bfloat16):
                pred = model(**kw)
            loss = ((pred.float() - target) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        step()
        step()
        with Recorder(pool) as r:
            step()
        traces[f"lora_step_{a.size}_{'ckpt' if ckpt else 'nockpt'}"] = r.result()
    for k, v in traces.items():
        print(f"{k}: {len(v['events'])} events, peak allocated {v['peak_allocated'] / 2**30:.2f} GiB, "
              f"peak reserved {v['peak_reserved'] / 2**30:.2f} GiB (start: {v['start_allocated'] / 2**30:.2f} / "
              f"{v['start_reserved'] / 2**30:.2f})", flush=True)
    with open(a.out, "w") as f:
        json.dump(traces, f)


if __name__ == "__main__":
    main()
