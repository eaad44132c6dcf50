"""Quality of fp8 compute at real width: a Flux-dev double block and single block (width 3072, 24 heads, MLP 12288,
random N(0, 0.02) weights, 1024x1024 image = 4096 tokens + T5 512), their output and input gradient under bf16
autocast compared with the same block computing in bf16:

    fp8 storage   the weights in e4m3 with a scale per output channel, dequantised to bf16 per matmul (today's path)
    fp8 compute   the weights in e4m3 with one scale per tensor, activations and output gradients quantised per
                  tensor (current scaling), the matmuls on the e4m3 tensor cores (flame_nn.offload.fp8_compute)

The figure is ||a - b|| / ||b|| against the bf16 block (and against float32); "bf16 vs fp32" (the bf16 block against
the same block in float32) says how far bf16 itself is from exact, for scale. The input gradient dX is that of
sum(out * G) for a fixed random G (for the double block: of txt and img together). The residual stream carries x and
G through unchanged and dominates both at this init, so the block's own part is compared too: out - x and dX - G
(bf16's rounding of the residual sum is in those). First, two single Linears (qkv's width -> 3x, the MLP's 4x ->
width) over the same tokens, x ~ N(0, 1): the matmul's own error without a residual stream, with the forward's
accumulation as configured (fp8_compute.FAST_ACCUM_FORWARD) and both ways ("precise": partial sums promoted to fp32;
"fast": not), and fast against precise (what the accumulation alone changes).
Run: PYTHONPATH=$PWD python3 bench/fp8_quality.py [--tokens 4096] [--txt 512] [--device cuda]
     (on the cpu: --width 256 --heads 2 --tokens 256 --txt 32 runs in seconds)
"""
import argparse

import common
import numpy as np


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(block_kind, a, res):
    import flame_core as flame
    from flame_core.amp import autocast
    from flame_models.bfl import sampling as Samp
    from flame_models.bfl.layers import DoubleStreamBlock, EmbedND, SingleStreamBlock
    from flame_nn.offload import quantize_linear_weights_
    dev = a.device
    rng = np.random.default_rng(0)
    H, heads = a.width, a.heads
    hd = H // heads
    axes = [hd - 2 * (3 * hd // 8), 3 * hd // 8, 3 * hd // 8]   # Flux-dev's 16, 56, 56 at head_dim 128
    side = int(round(a.tokens ** 0.5)) * 16
    pe = EmbedND(dim=hd, theta=10000, axes_dim=axes)(flame.cat((Samp.text_ids(a.txt, device=dev),
                                                                 Samp.image_ids(side, side, device=dev)), dim=1))
    weights = None
    inputs = {"img": rng.standard_normal((1, (side // 16) ** 2, H)), "txt": rng.standard_normal((1, a.txt, H)),
              "vec": rng.standard_normal((1, H))}
    outs = {}
    for mode in ("fp32", "bf16", "fp8 storage", "fp8 compute"):
        flame.manual_seed(0)
        dtype = flame.float32 if mode == "fp32" else flame.bfloat16
        if block_kind == "double":
            block = DoubleStreamBlock(H, heads, 4.0, qkv_bias=True, dtype=dtype, device=dev)
        else:
            block = SingleStreamBlock(H, heads, 4.0, dtype=dtype, device=dev)
        if weights is None:
            weights = {k: 0.02 * rng.standard_normal(tuple(p.shape)) if not k.endswith("scale") else
                       np.ones(tuple(p.shape)) for k, p in block.state_dict().items()}
        block.load_state_dict({k: flame.tensor(v, dtype=dtype, device=dev) for k, v in weights.items()})
        block.requires_grad_(False)
        if mode.startswith("fp8"):
            quantize_linear_weights_(block, compute="fp8" if mode == "fp8 compute" else None)
        t = {k: flame.tensor(v, dtype=dtype, device=dev, requires_grad=k != "vec") for k, v in inputs.items()}
        with autocast(flame.device(dev).type, dtype=flame.bfloat16, enabled=mode != "fp32"):
            if block_kind == "double":
                img, txt = block(t["img"], t["txt"], t["vec"], pe)
                out = flame.cat((txt, img), dim=1)
                grads_of = (t["txt"], t["img"])    # token order, as out
            else:
                x = flame.cat((t["txt"], t["img"]), dim=1).detach().requires_grad_(True)
                out = block(x, t["vec"], pe)
                grads_of = (x,)
        g_np = np.random.default_rng(1).standard_normal(tuple(out.shape))
        (out.float() * flame.tensor(g_np, dtype=flame.float32, device=dev)).sum().backward()
        y = out.detach().float().cpu().numpy()
        dx = np.concatenate([v.grad.float().cpu().numpy() for v in grads_of], axis=1)
        x_in = np.concatenate([inputs["txt"], inputs["img"]], axis=1)
        # the residual stream passes x and G through exactly: the block's own part is out - x and dx - G
        outs[mode] = (y, dx, y - x_in, dx - g_np)
        block = out = t = None
    rows = []
    for mode, ref in (("bf16", "fp32"), ("fp8 storage", "bf16"), ("fp8 compute", "bf16"), ("fp8 storage", "fp32"),
                      ("fp8 compute", "fp32")):
        errs = [_rel(m, r) for m, r in zip(outs[mode], outs[ref])]
        key = f"{block_kind}_{mode.replace(' ', '_')}_vs_{ref}"
        for name, e in zip(("out", "dx", "update", "dx_minus_g"), errs):
            res.log(f"{key}_{name}_rel", round(e, 5))
        rows.append([f"{block_kind} block", f"{mode} vs {ref}", *(round(e, 4) for e in errs)])
    return rows


def run_linear(a, res, n_in, n_out):
    """One Linear (n_in -> n_out) over all the tokens: no residual stream hides the matmuls' error here."""
    import flame_core as flame
    import flame_nn
    from flame_core.amp import autocast
    from flame_nn.offload import fp8_compute as FC
    from flame_nn.offload import quantize_linear_weights_
    rng = np.random.default_rng(2)
    tokens = (int(round(a.tokens ** 0.5))) ** 2 + a.txt
    w, b = 0.02 * rng.standard_normal((n_out, n_in)), rng.standard_normal(n_out) * 0.1
    x_np, g_np = rng.standard_normal((tokens, n_in)), rng.standard_normal((tokens, n_out))
    outs = {}
    fast = FC.FAST_ACCUM_FORWARD
    for mode in ("fp32", "bf16", "fp8 storage", "fp8 compute", "fp8 compute precise", "fp8 compute fast"):
        dtype = flame.float32 if mode == "fp32" else flame.bfloat16
        # the forward's accumulation: the default (FAST_ACCUM_FORWARD), promoted ("precise") or unpromoted ("fast")
        FC.FAST_ACCUM_FORWARD = {"fp8 compute precise": False, "fp8 compute fast": True}.get(mode, fast)
        lin = flame_nn.Linear(n_in, n_out, dtype=dtype, device=a.device)
        lin.load_state_dict({"weight": flame.tensor(w, dtype=dtype, device=a.device),
                             "bias": flame.tensor(b, dtype=dtype, device=a.device)})
        lin.requires_grad_(False)
        if mode.startswith("fp8"):
            quantize_linear_weights_(lin, compute="fp8" if mode.startswith("fp8 compute") else None)
        x = flame.tensor(x_np, dtype=dtype, device=a.device, requires_grad=True)
        with autocast(flame.device(a.device).type, dtype=flame.bfloat16, enabled=mode != "fp32"):
            y = lin(x)
        (y.float() * flame.tensor(g_np, dtype=flame.float32, device=a.device)).sum().backward()
        outs[mode] = (y.detach().float().cpu().numpy(), x.grad.float().cpu().numpy())
    FC.FAST_ACCUM_FORWARD = fast
    rows = []
    for mode, ref in (("bf16", "fp32"), ("fp8 storage", "fp32"), ("fp8 compute", "fp32"), ("fp8 compute", "bf16"),
                      ("fp8 compute precise", "fp32"), ("fp8 compute fast", "fp32"),
                      ("fp8 compute fast", "fp8 compute precise")):
        errs = [_rel(m, r) for m, r in zip(outs[mode], outs[ref])]
        key = f"linear_{n_in}x{n_out}_{mode.replace(' ', '_')}_vs_{ref}"
        res.log(f"{key}_out_rel", round(errs[0], 5))
        res.log(f"{key}_dx_rel", round(errs[1], 5))
        rows.append([f"Linear {n_in}->{n_out}", f"{mode} vs {ref}", *(round(e, 4) for e in errs), None, None])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=4096, help="image tokens (a square number)")
    ap.add_argument("--txt", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    res = common.Results("fp8_quality")
    rows = run_linear(a, res, a.width, 3 * a.width) + run_linear(a, res, 4 * a.width, a.width)
    rows += run("double", a, res) + run("single", a, res)
    res.save()
    print(common.table(["block", "compared", "out", "dX", "out - x", "dX - G"], rows,
                       title=f"\nfp8 quality at width {a.width}, {a.tokens}+{a.txt} tokens, random N(0, 0.02) "
                             f"weights, bf16 autocast (||a-b||/||b||)"))


if __name__ == "__main__":
    main()
