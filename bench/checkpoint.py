"""Gradient checkpointing on a stack of transformer blocks trained under bf16 autocast: activation memory, peak
memory and step time with and without checkpointing (and with the checkpointed inputs offloaded to pinned host
memory), FLAME side by side with PyTorch (torch.utils.checkpoint, same shapes and math) when torch is importable.

Activation memory = allocated bytes after the forward (graph alive) minus before it. Peak = max allocated during a
training step (forward, backward, optimizer). Step time: CUDA events around whole steps after warm-up, median.
Run: PYTHONPATH=$PWD python3 bench/checkpoint.py   (--small for a quick cpu check)
Prints a table last and writes $OUT/checkpoint.json.
"""
import argparse
import math
import statistics
import time

import common
import numpy as np

import flame_core as flame
from flame_core import amp
from flame_core import memory as M
from flame_core.checkpoint import maybe_checkpoint
from flame_nn.optim import AdamW


# ----------------------------------------------------------------------------- the model (flame_core ops only)
def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    return xc * ((xc * xc).mean(-1, keepdim=True) + eps).rsqrt() * w + b


def dropout(x, p):
    keep = (flame.rand(*x.shape, device=x.device) >= p).to(x.dtype)
    return x * keep * (1.0 / (1.0 - p))


class Block:
    def __init__(self, dim, heads, device, p_drop, rng):
        def param(*shape, scale, offset=0.0):
            a = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
            return flame.tensor(a, device=device, requires_grad=True)
        s = 1.0 / math.sqrt(dim)
        self.heads, self.p = heads, p_drop
        self.ln1_w, self.ln1_b = param(dim, scale=0.0, offset=1.0), param(dim, scale=0.0)
        self.w_qkv, self.b_qkv = param(dim, 3 * dim, scale=s), param(3 * dim, scale=0.0)
        self.w_proj, self.b_proj = param(dim, dim, scale=s / 4), param(dim, scale=0.0)
        self.ln2_w, self.ln2_b = param(dim, scale=0.0, offset=1.0), param(dim, scale=0.0)
        self.w_fc1, self.b_fc1 = param(dim, 4 * dim, scale=s), param(4 * dim, scale=0.0)
        self.w_fc2, self.b_fc2 = param(4 * dim, dim, scale=s / 8), param(dim, scale=0.0)

    def parameters(self):
        return [self.ln1_w, self.ln1_b, self.w_qkv, self.b_qkv, self.w_proj, self.b_proj, self.ln2_w, self.ln2_b,
                self.w_fc1, self.b_fc1, self.w_fc2, self.b_fc2]

    def __call__(self, x):
        B, L, D = x.shape
        H = self.heads
        # attention
        h = layer_norm(x, self.ln1_w, self.ln1_b)
        q, k, v = (h @ self.w_qkv + self.b_qkv).reshape(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.mT * (1.0 / math.sqrt(D // H))).softmax(-1)             # (B, H, L, L)
        y = (att @ v).transpose(1, 2).reshape(B, L, D)
        x = x + dropout(y @ self.w_proj + self.b_proj, self.p)
        # mlp
        h = layer_norm(x, self.ln2_w, self.ln2_b)
        return x + dropout((h @ self.w_fc1 + self.b_fc1).gelu() @ self.w_fc2 + self.b_fc2, self.p)


class Stack:
    gradient_checkpointing = False
    checkpoint_offload = False

    def __init__(self, n, dim, heads, device, p_drop, seed=0):
        rng = np.random.default_rng(seed)
        self.blocks = [Block(dim, heads, device, p_drop, rng) for _ in range(n)]

    def parameters(self):
        return [p for b in self.blocks for p in b.parameters()]

    def __call__(self, x):
        for block in self.blocks:
            x = maybe_checkpoint(block, x, enabled=self.gradient_checkpointing, offload=self.checkpoint_offload)
        return x


def measure(device):
    """Seconds of one fn() call: CUDA events on cuda, the wall clock on cpu."""
    def run(fn):
        if device.type == "cuda":
            return common.cuda_ms(fn, 1, warmup=0)[0] / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return run


def memory_now(device):
    if device.type == "cuda":
        common.synchronize()
    return M.memory_allocated(device)


def run_flame(args, device):
    flame.manual_seed(0)
    model = Stack(args.blocks, args.dim, args.heads, device, args.dropout)
    params = model.parameters()
    opt = AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(1)
    x = flame.tensor(rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32), device=device)
    target = flame.tensor(rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32) * 0.5,
                          device=device)
    timed = measure(device)

    def forward():
        with amp.autocast(device.type, dtype=args.dtype):
            y = model(x)
        return ((y.float() - target) ** 2).mean()

    def step(losses=None):
        loss = forward()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            losses.append(loss)

    # gradients of checkpointed vs plain from identical weights and RNG seeds (one backward each)
    grads = {}
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        flame.manual_seed(123)
        forward().backward()
        grads[ckpt] = [p.grad.float().numpy() for p in params]
        for p in params:
            p.grad = None
    rel = max(float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30)) for a, b in zip(grads[True], grads[False]))
    del grads

    rows = []
    for name, ckpt, off in (("plain", False, False), ("checkpoint", True, False),
                            ("checkpoint+offload", True, True)):
        if off and device.type != "cuda":
            continue
        model.gradient_checkpointing, model.checkpoint_offload = ckpt, off
        step()                                           # warm (kernels compiled, optimizer state made)
        M.reset_peak_memory_stats(device)
        before = memory_now(device)
        loss = forward()
        act = memory_now(device) - before
        loss.backward()
        opt.step()
        opt.zero_grad()
        memory_now(device)
        peak = M.max_memory_allocated(device)
        del loss
        for _ in range(args.warmup):
            step()
        losses = []
        times = [timed(lambda: step(losses)) for _ in range(args.steps)]
        lv = [float(v.item()) for v in losses]
        rows.append({"mode": name, "activation_bytes": int(act), "peak_bytes": int(peak),
                     "step_s": statistics.median(times), "step_s_min": min(times),
                     "loss_first": lv[0], "loss_last": lv[-1]})
    return {"grad_rel_diff_ckpt_vs_plain": rel, "params": int(sum(p.numel() for p in params)), "rows": rows}


def run_torch(args):
    import torch
    import torch.nn.functional as tF
    from torch.utils.checkpoint import checkpoint as tckpt
    dev = "cuda"
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype.name]
    torch.manual_seed(0)
    D, H = args.dim, args.heads

    class TBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
            self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
            self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).reshape(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
            att = (q @ k.transpose(-2, -1) * (1.0 / math.sqrt(D // H))).softmax(-1)  # same math as FLAME's
            y = (att @ v).transpose(1, 2).reshape(B, L, D)
            x = x + tF.dropout(self.proj(y), args.dropout)
            return x + tF.dropout(self.fc2(tF.gelu(self.fc1(self.ln2(x)))), args.dropout)

    blocks = torch.nn.ModuleList([TBlock() for _ in range(args.blocks)]).to(dev)
    opt = torch.optim.AdamW(blocks.parameters(), lr=args.lr, weight_decay=0.0)
    x = torch.randn(args.batch, args.seq, D, device=dev)
    target = torch.randn(args.batch, args.seq, D, device=dev) * 0.5

    def step(ckpt):
        with torch.autocast("cuda", dtype=tdt):
            h = x
            for b in blocks:
                h = tckpt(b, h, use_reentrant=False) if ckpt else b(h)
        loss = ((h.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    rows = []
    for name, ckpt in (("plain", False), ("checkpoint", True)):
        step(ckpt)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=tdt):
            h = x
            for b in blocks:
                h = tckpt(b, h, use_reentrant=False) if ckpt else b(h)
        loss = ((h.float() - target) ** 2).mean()
        torch.cuda.synchronize()
        act = torch.cuda.memory_allocated() - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del loss, h
        for _ in range(args.warmup):
            step(ckpt)
        times = [t / 1e3 for t in common.cuda_ms(lambda: step(ckpt), args.steps, 0, lib="torch")[2]]
        rows.append({"mode": name, "activation_bytes": int(act), "peak_bytes": int(peak),
                     "step_s": statistics.median(times), "step_s_min": min(times)})
    return {"version": torch.__version__, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="autocast dtype")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a cpu smoke run)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    args.dtype = getattr(flame, args.dtype)
    if args.small:
        args.blocks, args.dim, args.heads, args.seq, args.batch, args.steps = 4, 64, 4, 32, 2, 3
    device = flame.default_device()
    res = common.Results("checkpoint")
    res.log("config", {k: getattr(args, k) for k in ("blocks", "dim", "heads", "seq", "batch", "dropout", "lr",
                                                      "warmup", "steps")} | {"autocast": args.dtype.name})
    parts = [("FLAME", lambda: res.log("flame", run_flame(args, device)))]
    torch = None if args.no_torch or device.type != "cuda" else common.import_torch()
    if torch is not None:
        parts.append(("torch", lambda: res.log("torch", run_torch(args))))
    common.run_parts(res, parts)
    rows = []
    for impl in ("flame", "torch"):
        out = res.get(impl) or {}
        base = (out.get("rows") or [None])[0]
        for r in out.get("rows", []):
            rows.append([impl, r["mode"], round(r["activation_bytes"] / 2 ** 20, 1),
                         f"{base['activation_bytes'] / max(r['activation_bytes'], 1):.1f}x",
                         round(r["peak_bytes"] / 2 ** 20, 1), round(r["step_s"] * 1e3, 1),
                         round(r["step_s"] / base["step_s"], 2)])
    fl = res.get("flame") or {}
    print(common.table(["impl", "mode", "activation MiB", "reduction", "peak MiB", "step ms", "x plain"], rows,
                       title=f"\n{args.blocks} blocks, dim {args.dim}, heads {args.heads}, seq {args.seq}, batch "
                             f"{args.batch}, {args.dtype.name} autocast, dropout {args.dropout}, AdamW; max relative "
                             f"gradient difference checkpointed vs plain: {fl.get('grad_rel_diff_ckpt_vs_plain')}"))


if __name__ == "__main__":
    main()
