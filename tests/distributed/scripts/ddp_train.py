"""A worker for tests/distributed/test_ddp_processes.py, started by flame_core.distributed.run on the "store" backend.

    python -m flame_core.distributed.run --nproc-per-node N ddp_train.py OUT.json [--ckpt] [--accum K] [--steps S]

Every rank builds the same small model (a Linear, a gradient-checkpointed block, a Linear; parameters in two dtypes
is not needed here: float32 and float64 buffers come from a float64 head), trains `steps` SGD steps on its slice of
each global batch, and writes its parameters, per-step losses and the bucket launches it saw to OUT.json.rank<r>.
Rank 0 also replays the same steps in one process on whole global batches (no DDP) and writes those numbers: the
test compares them.
"""
import argparse
import json
import sys

import numpy as np

import flame_core as flame
import flame_core.distributed as dist
import flame_nn as nn
from flame_core.checkpoint import checkpoint
from flame_nn.parallel import DistributedDataParallel

B, D_IN, D_H, D_OUT = 3, 6, 10, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_H, D_H), nn.Linear(D_H, D_H)

    def forward(self, x):
        return x + self.fc2(flame.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(D_IN, D_H), Block(), nn.Linear(D_H, D_OUT)
        self.frozen = nn.Linear(D_OUT, D_OUT)
        self.frozen.requires_grad_(False)
        self.ckpt = ckpt

    def forward(self, x):
        h = flame.tanh(self.inp(x))
        h = checkpoint(self.block, h) if self.ckpt else self.block(h)
        h = checkpoint(self.block, h) if self.ckpt else self.block(h)  # the block's weights used twice
        return self.frozen(self.out(h))


def make_model(ckpt, seed):
    flame.manual_seed(seed)
    return Net(ckpt)


def global_batch(step, world):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((world * B, D_IN)).astype(np.float32)
    y = rng.standard_normal((world * B, D_OUT)).astype(np.float32)
    return x, y


def loss_of(model, x, y):
    return ((model(flame.tensor(x)) - flame.tensor(y)) ** 2).mean()


def params_of(model):
    return {n: p.detach().numpy().tolist() for n, p in model.named_parameters()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cap-mb", type=float, default=0.0005)
    a = ap.parse_args()
    dist.init_process_group(backend="store")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(a.ckpt, seed=1)
    with flame.no_grad():  # other trainable values off rank 0: DDP must broadcast rank 0's (frozen ones are equal)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(float(rank))
    ddp = DistributedDataParallel(model, bucket_cap_mb=a.cap_mb)
    opt = nn.optim.SGD(ddp.parameters(), lr=0.1)
    launches = []
    real_all_reduce = dist.all_reduce

    def spy(t, *args, **kw):  # records each bucket all-reduce: (step, micro-step, bucket start)
        launches.append([len(losses), t.data_ptr()])
        return real_all_reduce(t, *args, **kw)
    import flame_nn.parallel.distributed as ddp_mod
    ddp_mod.dist = _Patched(dist, spy)
    losses = []
    for step in range(a.steps):
        opt.zero_grad()
        for k in range(a.accum):
            x, y = global_batch(step * a.accum + k, world)
            mine = slice(rank * B, (rank + 1) * B)
            sync = k == a.accum - 1
            if sync:
                loss = loss_of(ddp, x[mine], y[mine]) / a.accum
                loss.backward()
            else:
                with ddp.no_sync():
                    loss = loss_of(ddp, x[mine], y[mine]) / a.accum
                    loss.backward()
            losses.append(float(loss.item()))
        opt.step()
    starts = {b.view.data_ptr(): b.index for b in ddp.buckets}
    result = {"rank": rank, "world": world, "params": params_of(model), "losses": losses,
              "buckets": len(ddp.buckets), "expected": ddp.expected, "stats": ddp.stats,
              "launches": [[s, starts.get(p, -1)] for s, p in launches]}
    if rank == 0:  # the same steps in one process, whole global batches
        ref = make_model(a.ckpt, seed=1)
        ropt = nn.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(a.steps):
            ropt.zero_grad()
            for k in range(a.accum):
                x, y = global_batch(step * a.accum + k, world)
                (loss_of(ref, x, y) / a.accum).backward()
            ropt.step()
        result["reference"] = params_of(ref)
    with open(f"{a.out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


class _Patched:
    """flame_core.distributed with all_reduce replaced by a spy."""

    def __init__(self, mod, spy):
        self._mod, self.all_reduce = mod, spy

    def __getattr__(self, name):
        return getattr(self._mod, name)


if __name__ == "__main__":
    sys.exit(main())
