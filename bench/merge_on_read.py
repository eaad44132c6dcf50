"""Merging a LoRA into Flux-dev's weights as they are read (model.lora_path / assistant_lora_path:
flame_models.pipeline.merged_loras.MergedLoRAs), against PyTorch doing the same merge (what diffusers' fuse_lora does
per layer: W <- W + s·B·A in float32, rounded to bf16).

Every Linear of Flux-dev's block stacks (19 double + 38 single blocks: 304 weights, 11.8 B parameters) with an r16
LoRA on each: FLAME's merger is given the bf16 weight on the GPU (as fill_ hands it over) and the file's factors in
host memory (as formats.load gives them: their copy in is part of its cost); torch's factors wait on the GPU already
(diffusers loads them there first). One buffer per distinct weight shape is reused (the merge's cost does not depend
on the values). Wall time of the whole pass to a synchronize, median of repeats, peer in the same process.
Run: PYTHONPATH=$PWD python3 bench/merge_on_read.py [--repeats 3] [--rank 16]
"""
import argparse
import time

import common
import numpy as np


def shapes():
    """[(key, (out, in))] of Flux-dev's block Linears, built without storage."""
    import flame_nn
    from flame_models.flux import Flux
    with flame_nn.empty_init(device="cpu"):
        model = Flux("flux-dev")
    return [(f"{n}.weight", tuple(m.weight.shape)) for n, m in model.named_modules()
            if isinstance(m, flame_nn.Linear) and n.startswith(("double_blocks.", "single_blocks."))]


def parts(layers, rank, seed=0):
    from flame_nn.adapters.formats import AdapterPart
    g = np.random.default_rng(seed)
    by_shape = {}
    for _, (o, i) in layers:
        if (o, i) not in by_shape:
            by_shape[(o, i)] = AdapterPart("lora", {"lora_down.weight": (g.standard_normal((rank, i)) * 0.01)
                                                    .astype(np.float32),
                                                    "lora_up.weight": (g.standard_normal((o, rank)) * 0.01)
                                                    .astype(np.float32)}, alpha=float(rank))
    return by_shape


def wall(fn, sync, repeats):
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return float(np.median(out)), out


def flame_part(res, layers, by_shape, repeats):
    import flame_core as flame
    from flame_models.pipeline.merged_loras import MergedLoRAs
    merger = MergedLoRAs([(1.0, {k[:-len(".weight")]: [by_shape[s]] for k, s in layers})], "cuda")
    weights = {s: (flame.randn(*s, device="cuda") * 0.02).to(flame.bfloat16) for s in by_shape}

    def run():
        for k, s in layers:
            merger(k, weights[s])
        merger.check()   # (merge_on_read's one finiteness read when the load returns)
    med, all_ = wall(run, lambda: common.synchronize("cupy"), repeats)
    res.log("flame_s", round(med, 3))
    res.log("flame_all_s", [round(v, 3) for v in all_])
    # one weight checked against float64 NumPy
    k, s = layers[0]
    got = merger(k, weights[s]).float().cpu().numpy()
    w = weights[s].float().cpu().numpy().astype(np.float64)
    want = by_shape[s].merged_weight(w)
    res.log("flame_max_rel_err", float(np.abs(got - want).max() / np.abs(want).max()))


def torch_part(res, layers, by_shape, repeats):
    import torch
    dev = "cuda"
    weights = {s: (torch.randn(*s, device=dev) * 0.02).to(torch.bfloat16) for s in by_shape}
    factors = {s: (torch.from_numpy(p.tensors["lora_up.weight"]).to(dev),
                   torch.from_numpy(p.tensors["lora_down.weight"]).to(dev), p.scale) for s, p in by_shape.items()}

    def run():
        for _, s in layers:
            up, down, scale = factors[s]
            w = weights[s]
            torch.add(w.float(), up @ down, alpha=scale).to(torch.bfloat16)
    med, all_ = wall(run, torch.cuda.synchronize, repeats)
    res.log("torch_s", round(med, 3))
    res.log("torch_all_s", [round(v, 3) for v in all_])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    res = common.Results("merge_on_read")
    layers = shapes()
    by_shape = parts(layers, a.rank)
    res.log("weights", len(layers))
    res.log("parameters_b", round(sum(o * i for _, (o, i) in layers) / 1e9, 2))
    common.run_parts(res, [("FLAME", lambda: flame_part(res, layers, by_shape, a.repeats)),
                           ("torch", lambda: torch_part(res, layers, by_shape, a.repeats))])
    print(common.table(["merge", "FLAME s", "torch s", "ratio"],
                       [[f"Flux-dev blocks, r{a.rank}, bf16", res.get("flame_s"), res.get("torch_s"),
                         common.ratio(res.get("flame_s"), res.get("torch_s"))]],
                       title=f"\nLoRA merged into {res['weights']} weights ({res['parameters_b']} B parameters), "
                             f"wall seconds to a synchronize (median of {a.repeats})"))
    res.save()


if __name__ == "__main__":
    main()
