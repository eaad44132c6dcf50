"""GPU check for tests/distributed/test_gpu_capture.py (1+ GPUs, nccl), started by flame_core.distributed.run:

    python -m flame_core.distributed.run --nproc-per-node N gpu_capture.py OUT

Collectives captured in a CUDA graph and replayed, on their own, between compute on the capturing stream, and
asynchronously (Work.wait inside the capture); then an eager collective after the replays (the communicator is
still in step). Each rank writes OUT.rank<r>.json with named checks (True or a message) or the exception.
"""
import json
import sys
import traceback

import flame_core as flame
import flame_core.distributed as dist


def checks(rank, world, dev):
    out = {}
    x = flame.full((1 << 20,), float(rank + 1), device=dev)
    y = flame.zeros(1 << 20, device=dev)
    g = flame.cuda.CUDAGraph()
    with flame.cuda.graph(g):
        x.add_(1.0)                      # compute before, on the capturing stream
        dist.all_reduce(x)               # synchronous form: the stream is ordered after it
        x.mul_(0.5)
        w = dist.all_reduce(y, async_op=True)
        w.wait()
        y.add_(x)
    xs, ys = [float(r + 1) for r in range(world)], [0.0] * world   # the same steps on the host, every rank
    for _ in range(3):
        g.replay()
        xv = sum(v + 1.0 for v in xs) * 0.5
        yv = sum(ys) + xv
        xs, ys = [xv] * world, [yv] * world
    got_x, got_y = x.numpy(), y.numpy()
    out["replayed_x"] = bool((got_x == xs[0]).all()) or f"x {got_x[:3]}, want {xs[0]}"
    out["replayed_y"] = bool((got_y == ys[0]).all()) or f"y {got_y[:3]}, want {ys[0]}"
    z = flame.full((7,), float(rank), device=dev)
    dist.all_reduce(z)                   # eager after the replays
    out["eager_after"] = float(z.numpy()[0]) == float(sum(range(world))) or f"{z.numpy()[0]}"
    dist.barrier()
    return out, g


def main():
    path = sys.argv[1]
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    res, g = {}, None
    try:
        out, g = checks(rank, world, flame.default_device())
        res.update(out)
    except Exception:  # noqa: BLE001 - reported to the test
        res["exception"] = traceback.format_exc()
    # the graph holding collectives is still alive: closing the group releases it (NCCL would wait for it)
    dist.destroy_process_group()
    if g is not None:
        res["graph_released_at_close"] = g._graph is None
    with open(f"{path}.rank{rank}.json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
