"""Eager per-op host cost of common ops, FLAME vs PyTorch in one process (issue 48): one op's forward on tiny float32
tensors that require grad (the graph is recorded), in µs per call.

What is timed: 300 calls of one op, ended by a device synchronize on cuda, divided by 300; the median of 7 such
batches; per op FLAME's batches first, then torch's, twice, and each side's smaller median is kept. The tensors are
tiny (x (8, 16, 32), an image (2, 8, 8, 8)), so the figure is the host's cost of issuing the op (Python, array
library, launches, bookkeeping), the eager user's experience outside a captured graph, not kernel speed. Where the
elementwise chain of `overhead.py` holds FLAME's tuned ops, these are the rest of an eager model's ops: views, joins,
reductions, norms, softmax, attention, convolution, dropout, embedding, losses.

Run: PYTHONPATH=$PWD python3 bench/eager_ops.py [--device cpu|cuda] [--ops name,name]
Prints the table sorted by the ratio (worst first) and writes $OUT/eager_ops_<device>.json.
"""
import argparse
import statistics
import time

import common
import numpy as np

import flame_core as flame
import flame_nn.functional as F


def per_call(fn, sync, n=300, rep=7):
    """Median over `rep` batches of the µs per call of `n` calls (synchronized)."""
    out = []
    for _ in range(rep):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def _tensors(lib, device, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    a = rng.standard_normal((8, 16, 32)).astype(np.float32)
    w = rng.standard_normal((32,)).astype(np.float32)
    img = rng.standard_normal((2, 8, 8, 8)).astype(np.float32)
    cw = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    idx = rng.integers(0, 16, (8, 4))
    emb = rng.standard_normal((16, 32)).astype(np.float32)
    d = device
    return (lib.tensor(a, requires_grad=True, device=d), lib.tensor(w, requires_grad=True, device=d),
            lib.tensor(w * 0, requires_grad=True, device=d), lib.tensor(img, requires_grad=True, device=d),
            lib.tensor(cw, requires_grad=True, device=d), lib.tensor(idx, device=d),
            lib.tensor(emb, requires_grad=True, device=d))


def cases(lib, fn, device):
    """name -> a no-argument call of one op (lib: flame_core or torch; fn: its functional module)."""
    x, g, b, im, k, ix, emb = _tensors(lib, device)
    return {
        "slice x[:, 0]": lambda: x[:, 0],
        "index x[1]": lambda: x[1],
        "view": lambda: x.view(8, 512),
        "reshape": lambda: x.reshape(-1, 32),
        "permute": lambda: x.permute(0, 2, 1),
        "transpose": lambda: x.transpose(1, 2),
        "contiguous(T)": lambda: x.transpose(1, 2).contiguous(),
        "unsqueeze": lambda: x.unsqueeze(1),
        "cat": lambda: lib.cat([x, x], 1),
        "stack": lambda: lib.stack([x, x]),
        "chunk": lambda: x.chunk(2, -1),
        "sum(dim)": lambda: x.sum(-1),
        "mean(dim)": lambda: x.mean(-1, keepdim=True),
        "softmax": lambda: fn.softmax(x, -1),
        "layer_norm": lambda: fn.layer_norm(x, (32,), g, b),
        "gelu": lambda: fn.gelu(x),
        "silu": lambda: fn.silu(x),
        "dropout": lambda: fn.dropout(x, 0.1, True),
        "x * g (bcast)": lambda: x * g,
        "x + x": lambda: x + x,
        "pow 2": lambda: x ** 2,
        "exp": lambda: x.exp(),
        "clamp": lambda: x.clamp(-1, 1),
        "where": lambda: lib.where(x > 0, x, 0.0),
        "masked_fill": lambda: x.masked_fill(x > 0, 0.0),
        "embedding": lambda: fn.embedding(ix, emb),
        "conv2d": lambda: fn.conv2d(im, k, padding=1),
        "sdpa": lambda: fn.scaled_dot_product_attention(x[None], x[None], x[None]),
        "matmul bmm": lambda: x @ x.transpose(1, 2),
        "group_norm": lambda: fn.group_norm(im, 4),
        "mse_loss": lambda: fn.mse_loss(x, x.detach()),
        "to(bf16)": lambda: x.to(lib.bfloat16),
        "split": lambda: x.split(8, -1),
        "flatten": lambda: x.flatten(1),
        "expand": lambda: g.expand(8, 32),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if flame.cuda_is_available() else "cpu")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    args = ap.parse_args()
    torch = common.import_torch()
    if torch is None:
        raise SystemExit("eager_ops.py compares with PyTorch: torch is not importable")
    torch.set_num_threads(1)
    if args.device == "cuda":
        import cupy
        fsync, tsync = cupy.cuda.Device().synchronize, torch.cuda.synchronize
    else:
        def fsync():
            pass
        tsync = fsync
    ours = cases(flame, F, args.device)
    theirs = cases(torch, torch.nn.functional, args.device)
    names = [n for n in ours if not args.ops or n in args.ops.split(",")]
    res = common.Results(f"eager_ops_{args.device}")
    rows = []
    for name in names:
        f, t = ours[name], theirs[name]
        f()
        t()
        ff, tt = per_call(f, fsync), per_call(t, tsync)
        ff2, tt2 = per_call(f, fsync), per_call(t, tsync)
        row = res.log(name, {"flame_us": min(ff, ff2), "torch_us": min(tt, tt2)})
        row["ratio"] = row["flame_us"] / row["torch_us"]
        rows.append([name, f"{row['flame_us']:.2f}", f"{row['torch_us']:.2f}", f"{row['ratio']:.2f}"])
    res.save()
    rows.sort(key=lambda r: -float(r[3]))
    print(common.table(["op", "FLAME us/call", "torch us/call", "ratio"], rows,
                       title=f"eager per-op host cost on {args.device} (forward, requires_grad inputs)"))


if __name__ == "__main__":
    main()
