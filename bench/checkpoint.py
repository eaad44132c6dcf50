"""Gradient checkpointing on a stack of transformer blocks trained under bf16 autocast: activation memory, peak
memory and step time with and without checkpointing (and with the checkpointed inputs offloaded to pinned host
memory), FLAME side by side with PyTorch (torch.utils.checkpoint, same shapes and math) when torch is importable.

Activation memory = allocated bytes after the forward (graph alive) minus before it. Peak = max allocated during a
training step (forward, backward, optimizer). Step time: CUDA events around whole steps after warm-up, median.
Run: PYTHONPATH=$PWD python3 bench/checkpoint.py   (--small for a quick cpu check)
Prints a table last and writes JSON (--out, default $OUT/checkpoint.json or ./checkpoint.json).
"""
import argparse
import json
import math
import os
import statistics
import time

import numpy as np

import flame_core as flame
from flame_core import amp, backend
from flame_core.checkpoint import maybe_checkpoint

try:  # before any allocation: installs FLAME's pool on cuda, so every array is counted
    from flame_core import memory as _memory  # noqa: F401
except ImportError:
    _memory = None


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


class SGD:
    """Fallback when flame_nn.optim is not importable."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    def step(self):
        for p in self.params:
            if p.grad is not None:
                p._data -= self.lr * p.grad._data

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def make_optimizer(params, lr):
    try:
        from flame_nn.optim import AdamW
        return AdamW(params, lr=lr, weight_decay=0.0), "flame_nn.optim.AdamW"
    except Exception:  # noqa: BLE001 - the bench must run on a partial tree too
        return SGD(params, lr * 10), "SGD (inline)"


# ----------------------------------------------------------------------------- measuring
class Meter:
    """Allocated bytes now / peak since reset: flame_core.memory when importable, else CuPy's pool or tracemalloc."""

    def __init__(self, device):
        self.device = device
        try:
            from flame_core import memory as M
            M.memory_allocated(device)
            self.M, self.source = M, "flame_core.memory"
        except Exception:  # noqa: BLE001
            self.M, self.source = None, ("cupy pool" if device.type == "cuda" else "tracemalloc")
            if device.type == "cpu":
                import tracemalloc
                tracemalloc.start()
        self._peak_fallback = 0

    def sync(self):
        if self.device.type == "cuda":
            backend.cupy.cuda.Device().synchronize()

    def allocated(self):
        self.sync()
        if self.M is not None:
            return self.M.memory_allocated(self.device)
        if self.device.type == "cuda":
            return backend.cupy.get_default_memory_pool().used_bytes()
        import tracemalloc
        return tracemalloc.get_traced_memory()[0]

    def reset_peak(self):
        self.sync()
        if self.M is not None:
            self.M.reset_peak_memory_stats(self.device)
        elif self.device.type == "cuda":
            pool = backend.cupy.get_default_memory_pool()
            pool.free_all_blocks()
        else:
            import tracemalloc
            tracemalloc.reset_peak()

    def peak(self):
        self.sync()
        if self.M is not None:
            return self.M.max_memory_allocated(self.device)
        if self.device.type == "cuda":  # reserved after free_all_blocks at reset: the high-water mark
            return backend.cupy.get_default_memory_pool().total_bytes()
        import tracemalloc
        return tracemalloc.get_traced_memory()[1]


def timer(device):
    if device.type == "cuda":
        cp = backend.cupy

        def measure(fn):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            return cp.cuda.get_elapsed_time(a, b) / 1e3
        return measure

    def measure(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return measure


def run_flame(args, device):
    flame.manual_seed(0)
    model = Stack(args.blocks, args.dim, args.heads, device, args.dropout)
    params = model.parameters()
    opt, opt_name = make_optimizer(params, args.lr)
    rng = np.random.default_rng(1)
    x = flame.tensor(rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32), device=device)
    target = flame.tensor(rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32) * 0.5,
                          device=device)
    meter, measure = Meter(device), timer(device)

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
        meter.reset_peak()
        before = meter.allocated()
        loss = forward()
        act = meter.allocated() - before
        loss.backward()
        opt.step()
        opt.zero_grad()
        peak = meter.peak()
        del loss
        for _ in range(args.warmup):
            step()
        losses = []
        times = [measure(lambda: step(losses)) for _ in range(args.steps)]
        lv = [float(v.item()) for v in losses]
        rows.append({"mode": name, "activation_bytes": int(act), "peak_bytes": int(peak),
                     "step_s": statistics.median(times), "step_s_min": min(times),
                     "loss_first": lv[0], "loss_last": lv[-1]})
    return {"optimizer": opt_name, "memory_source": meter.source, "grad_rel_diff_ckpt_vs_plain": rel,
            "params": int(sum(p.numel() for p in params)), "rows": rows}


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
        times = []
        for _ in range(args.steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(ckpt)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        rows.append({"mode": name, "activation_bytes": int(act), "peak_bytes": int(peak),
                     "step_s": statistics.median(times), "step_s_min": min(times)})
    return {"version": torch.__version__, "rows": rows}


def main():
    ap = argparse.ArgumentParser()
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
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "checkpoint.json"))
    args = ap.parse_args()
    args.dtype = flame.dtype(args.dtype) if hasattr(flame, "dtype") else getattr(flame, args.dtype)
    if args.small:
        args.blocks, args.dim, args.heads, args.seq, args.batch, args.steps = 4, 64, 4, 32, 2, 3
    device = flame.default_device()
    config = {k: getattr(args, k) for k in ("blocks", "dim", "heads", "seq", "batch", "dropout", "lr", "warmup",
                                             "steps")}
    config["autocast_dtype"] = args.dtype.name
    result = {"device": str(device), "config": config}
    try:
        result["flame"] = run_flame(args, device)
    except Exception as e:  # noqa: BLE001 - keep the peer figures and say what broke
        import traceback
        traceback.print_exc()
        result["flame"] = {"error": f"{type(e).__name__}: {e}"}
    if device.type == "cuda":
        import cupy
        result["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if not args.no_torch and device.type == "cuda":
        try:
            result["torch"] = run_torch(args)
        except ImportError:
            result["torch"] = None
        except Exception as e:  # noqa: BLE001
            result["torch"] = {"error": f"{type(e).__name__}: {e}"}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    fl = result["flame"]
    mib = 1 << 20
    print(f"\n{args.blocks} blocks, dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, "
          f"{args.dtype.name} autocast, dropout {args.dropout}; device {result.get('gpu', device)}")
    if "error" in fl:
        print(f"FLAME failed: {fl['error']}")
    else:
        print(f"{fl['params'] / 1e6:.1f}M params, {fl['optimizer']}, memory from {fl['memory_source']}; max relative "
              f"gradient difference checkpointed vs plain (same seed): {fl['grad_rel_diff_ckpt_vs_plain']:.2e}")
    print(f"{'impl':6s} {'mode':20s} {'act MiB':>9s} {'act /':>6s} {'peak MiB':>9s} {'step ms':>8s} {'x plain':>8s} "
          f"{'loss first->last':>18s}")
    base = fl["rows"][0] if "rows" in fl else None
    for r in fl.get("rows", []):
        print(f"{'flame':6s} {r['mode']:20s} {r['activation_bytes'] / mib:9.1f} "
              f"{base['activation_bytes'] / max(r['activation_bytes'], 1):6.1f} {r['peak_bytes'] / mib:9.1f} "
              f"{r['step_s'] * 1e3:8.1f} {r['step_s'] / base['step_s']:8.2f} "
              f"{r['loss_first']:8.4f}->{r['loss_last']:8.4f}")
    if result.get("torch") and "rows" in result["torch"]:
        tb = result["torch"]["rows"][0]
        for r in result["torch"]["rows"]:
            print(f"{'torch':6s} {r['mode']:20s} {r['activation_bytes'] / mib:9.1f} "
                  f"{tb['activation_bytes'] / max(r['activation_bytes'], 1):6.1f} {r['peak_bytes'] / mib:9.1f} "
                  f"{r['step_s'] * 1e3:8.1f} {r['step_s'] / tb['step_s']:8.2f} {'':>18s}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
