"""GPU check for tests/distributed/test_gpu_ddp.py (2+ GPUs, nccl), started by flame_core.distributed.run:

    python -m flame_core.distributed.run --nproc-per-node 2 gpu_collectives.py OUT

Each rank writes OUT.rank<r>.json with named checks (True or a message): NVLS off, the rank's device, every
collective against values computed here, async ordering against the compute stream, and DistributedDataParallel of
a small model (a gradient-checkpointed block used twice) eagerly and replayed as a captured CUDA graph, against one
model trained on the whole global batch on this GPU.
"""
import json
import os
import sys
import traceback

import numpy as np

import flame_core as flame
import flame_core.distributed as dist
import flame_nn as nn
from flame_core.checkpoint import checkpoint
from flame_nn.parallel import DistributedDataParallel

B = 4


def per_rank(r, shape, dtype=np.float32):
    return (np.random.default_rng(r).standard_normal(shape) * 2).astype(dtype)


def check_collectives(rank, world, dev):
    out = {}
    out["nvls_off"] = os.environ.get("NCCL_NVLS_ENABLE") == "0"
    out["device"] = str(flame.default_device()) == f"cuda:{os.environ['LOCAL_RANK']}"
    allv = np.stack([per_rank(r, (3, 5)).astype(np.float64) for r in range(world)])
    for op, ref in ((dist.ReduceOp.SUM, allv.sum(0)), (dist.ReduceOp.AVG, allv.mean(0)),
                    (dist.ReduceOp.MAX, allv.max(0)), (dist.ReduceOp.MIN, allv.min(0)),
                    (dist.ReduceOp.PRODUCT, allv.prod(0))):
        for dt, tol in ((flame.float32, 1e-5), (flame.bfloat16, 3e-2), (flame.float16, 3e-3)):
            t = flame.tensor(per_rank(rank, (3, 5)), device=dev).to(dt)
            dist.all_reduce(t, op=op)
            got = t.float().numpy()
            want = ref if dt == flame.float32 else \
                {"SUM": np.sum, "AVG": np.mean, "MAX": np.max, "MIN": np.min, "PRODUCT": np.prod}[op.name](
                    np.stack([flame.tensor(per_rank(r, (3, 5))).to(dt).float().numpy() for r in range(world)]), 0)
            ok = np.allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
            out[f"all_reduce_{op.name}_{dt}"] = bool(ok) or f"max err {np.abs(got - want).max()}"
    t = flame.tensor(np.arange(6, dtype=np.int64) * (rank + 1), device=dev)
    dist.all_reduce(t)
    out["all_reduce_int64"] = t.numpy().tolist() == (np.arange(6) * sum(range(1, world + 1))).tolist()
    b = flame.tensor(per_rank(rank, (7,)), device=dev)
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = np.array_equal(b.numpy(), per_rank(world - 1, (7,)))
    lst = [flame.zeros(2, 3, device=dev) for _ in range(world)]
    dist.all_gather(lst, flame.tensor(per_rank(rank, (2, 3)), device=dev))
    out["all_gather"] = all(np.array_equal(lst[r].numpy(), per_rank(r, (2, 3))) for r in range(world))
    into = flame.zeros(world * 2, 3, device=dev)
    dist.all_gather_into_tensor(into, flame.tensor(per_rank(rank, (2, 3)), device=dev))
    out["all_gather_into_tensor"] = np.array_equal(into.numpy(),
                                                   np.concatenate([per_rank(r, (2, 3)) for r in range(world)]))
    o = flame.zeros(4, device=dev)
    dist.reduce_scatter_tensor(o, flame.tensor(per_rank(10 + rank, (4 * world,)), device=dev))
    want = sum(per_rank(10 + r, (4 * world,)).astype(np.float64) for r in range(world))[rank * 4:(rank + 1) * 4]
    out["reduce_scatter_tensor"] = bool(np.allclose(o.numpy(), want, rtol=1e-5, atol=1e-5))
    # async: the collective waits for the compute stream's work queued before it, and wait() orders what follows
    big = flame.full((1 << 24,), 0.0, device=dev)
    big.add_(float(rank + 1))  # queued on the compute stream just before
    w = dist.all_reduce(big, async_op=True)
    w.wait()
    big.mul_(2.0)
    out["async_ordering"] = float(big.numpy()[-1]) == 2.0 * sum(range(1, world + 1))
    dist.barrier()
    return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        flame.manual_seed(0)
        self.inp, self.fc, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def block(self, h):
        return h + self.fc(h).tanh()

    def forward(self, x):
        h = checkpoint(self.block, self.inp(x).tanh())
        return self.out(checkpoint(self.block, h))


def grads_of(model):
    return np.concatenate([p.grad.float().numpy().ravel() for p in model.parameters()])


def check_ddp(rank, world, dev):
    out = {}
    model, ref = Net().to(dev), Net().to(dev)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)  # ~1000 floats: several buckets
    out["buckets"] = len(ddp.buckets) >= 3
    with flame.no_grad():  # the reference starts from rank 0's parameters too (the DDP broadcast them)
        for q, p in zip(ref.parameters(), model.parameters()):
            q.copy_(p)

    def data(step):
        x = per_rank(100 + step, (world * B, 16))
        return x, per_rank(200 + step, (world * B, 8))

    def step_loss(m, x, y):
        return ((m(x) - y) ** 2).mean()

    def fwd_bwd(x, y):
        loss = step_loss(ddp, x, y)
        loss.backward()
        return loss.detach()
    graphed = flame.cuda.graphed(fwd_bwd, warmup=2)
    for step in range(5):  # 2 eager, then capture, then replays: the captured all-reduces run on replay
        x, y = data(step)
        mine = slice(rank * B, (rank + 1) * B)
        model.zero_grad(set_to_none=False)
        graphed(flame.tensor(x[mine], device=dev), flame.tensor(y[mine], device=dev))
        ref.zero_grad(set_to_none=False)
        step_loss(ref, flame.tensor(x, device=dev), flame.tensor(y, device=dev)).backward()
        got, want = grads_of(model), grads_of(ref)
        ok = np.allclose(got, want, rtol=1e-4, atol=1e-6)
        out[f"ddp_step{step}_{'eager' if step < 2 else 'graph'}"] = bool(ok) or \
            f"max err {np.abs(got - want).max()} of {np.abs(want).max()}"
    out["graph_captured"] = graphed.graph is not None
    every = flame.zeros(world * got.size, device=dev)
    dist.all_gather_into_tensor(every, flame.tensor(got, device=dev))
    rows = every.numpy().reshape(world, -1)
    out["ranks_identical"] = all(np.array_equal(rows[0], rows[r]) for r in range(world))
    out["stats"] = ddp.stats["buckets_overlapped"] > 0 or f"{ddp.stats}"
    return out


def main():
    path = sys.argv[1]
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = flame.default_device()
    res = {}
    try:
        res.update(check_collectives(rank, world, dev))
        res.update(check_ddp(rank, world, dev))
    except Exception:  # noqa: BLE001 - reported to the test
        res["exception"] = traceback.format_exc()
    with open(f"{path}.rank{rank}.json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
