"""Data parallelism on 2 GPUs: all-reduce bus bandwidth (FLAME's NCCL through CuPy vs torch.distributed's NCCL)
and Flux-dev LoRA training throughput on 1 and 2 GPUs.

Run: PYTHONPATH=$PWD python3 bench/ddp.py [--gpus 2] [--sizes-mib 1,4,16,64,256,1024] [--dtype float32]
                                         [--flux-size 1024] [--flux-steps 5] [--no-graph] [--no-ckpt]
                                         [--skip-torch] [--skip-flux] [--skip-allreduce]

This script only orchestrates; each measurement runs in worker processes (this file with --worker) that it starts:
- FLAME all-reduce: `python -m flame_core.distributed.run --nproc-per-node N bench/ddp.py --worker flame-allreduce`
  (our launcher; FLAME's NCCL communicator, the collective on FLAME's communication stream);
- torch all-reduce: `python -m torch.distributed.run --nproc-per-node N bench/ddp.py --worker torch-allreduce`
  (torchrun; torch.distributed with the NCCL backend), in the same run, right after;
- FLAME under torchrun: the 64 MiB point again, FLAME started by torchrun (checks that torchrun's environment
  works: FLAME's store takes MASTER_PORT + 1 there);
- Flux-dev LoRA: one process on GPU 0 (no DDP), then N ranks through our launcher with DistributedDataParallel.
Every child runs with NCCL_NVLS_ENABLE=0 (NVLink multicast stays off, for both frameworks).

All-reduce: a float32 tensor of each size, in place, SUM; `iters` back-to-back calls between CUDA events on the
caller's stream (both frameworks run NCCL on a stream of their own, ordered by events), median of 5 intervals after
warm-up. algbw = bytes / time; busbw = algbw · 2(N-1)/N (nccl-tests' definition).
Flux-dev LoRA: as bench/flux_lora.py (random-init bf16 Flux-dev, LoRA r16 on the attention projections, fp32
adapters, AdamW, bf16 autocast, T5 512, batch 1 per GPU; gradient checkpointing on and forward + backward as a CUDA
graph unless --no-ckpt / --no-graph); each rank its own random inputs. images/s = N · 1000 / (median ms per step);
a step = forward, backward (the DDP all-reduces in it), AdamW, zero_grad.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import common

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


# ----------------------------------------------------------------------------- workers
def _rank():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _write(path, rank, obj):
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump(obj, f)


def _iters(nbytes):
    return max(5, min(100, (256 << 20) // max(nbytes, 1)))


def worker_flame_allreduce(a):
    import flame_core as flame
    import flame_core.distributed as dist
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = flame.default_device()
    dt = flame.dtypes.dtype(a.dtype)
    out = {"world": world, "device": str(dev), "nccl": dist.default_group().backend.version}
    for mib in a.sizes_mib:
        n = int(mib * 2 ** 20) // dt.itemsize
        t = flame.ones(n, dtype=dt, device=dev)
        ms = common.cuda_ms(lambda: dist.all_reduce(t), repeats=5, warmup=3, inner=_iters(n * dt.itemsize))[0]
        out[str(mib)] = ms
    dist.barrier()
    _write(a.out, rank, out)
    dist.destroy_process_group()


def worker_torch_allreduce(a):
    import torch
    import torch.distributed as tdist
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    tdist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dt = getattr(torch, a.dtype)
    out = {"world": world, "nccl": ".".join(str(v) for v in torch.cuda.nccl.version())}
    for mib in a.sizes_mib:
        n = int(mib * 2 ** 20) // torch.empty((), dtype=dt).element_size()
        t = torch.ones(n, dtype=dt, device="cuda")
        ms = common.cuda_ms(lambda: tdist.all_reduce(t), repeats=5, warmup=3, inner=_iters(t.nbytes),
                            lib="torch")[0]
        out[str(mib)] = ms
    tdist.barrier()
    _write(a.out, rank, out)
    tdist.destroy_process_group()


def worker_flux(a):
    import flame_core as flame
    import flame_core.distributed as dist
    import flame_core.memory as fmem
    import flame_nn
    from flame_models.flux.lora_keys import name_map_for
    from flame_models.flux.params import configs as presets
    from flame_nn import adapters as A
    rank, world = _rank()
    if world > 1:
        dist.init_process_group("nccl")
        dev = flame.default_device()
    else:
        dev = flame.device("cuda:0")
    p = presets["flux-dev"]
    model = common.random_flux(p, device=dev)
    A.inject_adapters(model, TARGETS, "lora", rank=16, alpha=16, name_map=name_map_for(p),
                      generator=flame.Generator(dev).manual_seed(1))
    lora = A.adapter_parameters(model)
    model.train()
    model.enable_gradient_checkpointing(a.ckpt)
    opt = flame_nn.optim.AdamW(lora, lr=1e-4)
    ddp = None
    if world > 1:
        ddp = flame_nn.parallel.DistributedDataParallel(model, parameters=A.named_adapter_parameters(model))
    kw, target = common.flame_flux_inputs(a.flux_size, guidance=1.0, seed=1 + rank, device=dev)

    run = flame.cuda.graphed(common.flame_flux_loss_step(model, kw), warmup=2, enabled=a.graph)

    def step():
        run(kw["img"], kw["txt"], kw["y"], target)
        opt.step()
        opt.zero_grad(set_to_none=not a.graph)
    for _ in range(3):  # eager warm-up (and DDP's first, learning backward), then the capture
        step()
    common.synchronize()
    fmem.reset_peak_memory_stats()
    ms = common.cuda_ms(step, repeats=3, warmup=0, inner=a.flux_steps)[0]
    out = {"world": world, "ms_per_step": ms, "images_per_s": world * 1000.0 / ms,
           "peak_GiB": common.gib(fmem.max_memory_allocated()), "lora_params": sum(q.numel() for q in lora)}
    if ddp is not None:
        out["buckets"] = len(ddp.buckets)
        out["ddp_stats"] = ddp.stats
        dist.barrier()
    _write(a.out, rank, out)
    if world > 1:
        dist.destroy_process_group()


WORKERS = {"flame-allreduce": worker_flame_allreduce, "torch-allreduce": worker_torch_allreduce,
           "flux": worker_flux}


# ----------------------------------------------------------------------------- orchestration
def _child_env():
    env = dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _spawn(launcher, nproc, worker, out, a, extra=()):
    """Run the workers; returns the per-rank results (or raises with the children's output)."""
    args = [HERE, "--worker", worker, "--out", out, "--sizes-mib", ",".join(str(s) for s in a.sizes_mib),
            "--dtype", a.dtype, "--flux-size", str(a.flux_size), "--flux-steps", str(a.flux_steps),
            *(["--no-graph"] if not a.graph else []), *(["--no-ckpt"] if not a.ckpt else []), *extra]
    if launcher == "none":
        cmd = [sys.executable] + args
    elif launcher == "flame":
        cmd = [sys.executable, "-m", "flame_core.distributed.run", "--nproc-per-node", str(nproc)] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master_port", str(a.torch_port)] + args
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=_child_env(), timeout=a.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{worker} under {launcher} exited with {r.returncode}")
    return [json.load(open(f"{out}.rank{k}")) for k in range(nproc)]


def busbw(mib, ms, world):
    if not isinstance(ms, (int, float)):
        return None
    algbw = mib * 2 ** 20 / (ms / 1e3) / 1e9
    return round(algbw * 2 * (world - 1) / world, 1)


def allreduce_part(res, a, tmp):
    n = a.gpus
    fl = _spawn("flame", n, "flame-allreduce", os.path.join(tmp, "fa"), a)
    res.log("flame_nccl_version", fl[0]["nccl"])
    for mib in a.sizes_mib:
        ms = max(r[str(mib)] for r in fl)  # the slowest rank's figure
        res.log(f"flame_allreduce_{mib}MiB_ms", round(ms, 4))
        res.log(f"flame_allreduce_{mib}MiB_busbw_GBps", busbw(mib, ms, n))
    if a.skip_torch or common.import_torch() is None:
        return
    to = _spawn("torch", n, "torch-allreduce", os.path.join(tmp, "ta"), a)
    res.log("torch_nccl_version", to[0]["nccl"])
    for mib in a.sizes_mib:
        ms = max(r[str(mib)] for r in to)
        res.log(f"torch_allreduce_{mib}MiB_ms", round(ms, 4))
        res.log(f"torch_allreduce_{mib}MiB_busbw_GBps", busbw(mib, ms, n))
    check = argparse.Namespace(**{**vars(a), "sizes_mib": [64]})
    ft = _spawn("torch", n, "flame-allreduce", os.path.join(tmp, "ft"), check)
    ms = max(r["64"] for r in ft)
    res.log("flame_under_torchrun_allreduce_64MiB_busbw_GBps", busbw(64, ms, n))


def flux_part(res, a, tmp):
    one = _spawn("none", 1, "flux", os.path.join(tmp, "f1"), a)[0]
    res.log("flux_1gpu_ms_per_step", round(one["ms_per_step"], 1))
    res.log("flux_1gpu_images_per_s", round(one["images_per_s"], 3))
    res.log("flux_1gpu_peak_GiB", one["peak_GiB"])
    many = _spawn("flame", a.gpus, "flux", os.path.join(tmp, "fn"), a)
    ms = max(r["ms_per_step"] for r in many)
    res.log(f"flux_{a.gpus}gpu_ms_per_step", round(ms, 1))
    res.log(f"flux_{a.gpus}gpu_images_per_s", round(a.gpus * 1000.0 / ms, 3))
    res.log(f"flux_{a.gpus}gpu_peak_GiB", max(r["peak_GiB"] for r in many))
    res.log(f"flux_{a.gpus}gpu_buckets", many[0]["buckets"])
    res.log(f"flux_{a.gpus}gpu_ddp_stats_rank0", many[0]["ddp_stats"])
    res.log(f"flux_speedup_{a.gpus}gpu", round(a.gpus * 1000.0 / ms / one["images_per_s"], 3))


def report(res, a):
    rows = []
    for mib in a.sizes_mib:
        f, t = res.get(f"flame_allreduce_{mib}MiB_busbw_GBps"), res.get(f"torch_allreduce_{mib}MiB_busbw_GBps")
        rows.append([mib, res.get(f"flame_allreduce_{mib}MiB_ms"), f, res.get(f"torch_allreduce_{mib}MiB_ms"), t,
                     common.ratio(f, t)])
    lines = [] if a.skip_allreduce else [common.table(["MiB", "FLAME ms", "FLAME busbw GB/s", "torch ms",
                                                       "torch busbw GB/s", "busbw FLAME/torch"], rows,
                          title=f"\nall-reduce {a.dtype} SUM on {a.gpus} GPUs (NCCL_NVLS_ENABLE=0); FLAME started by "
                                f"flame_core.distributed.run, torch by torchrun")]
    if "flux_1gpu_images_per_s" in res:
        n = a.gpus
        lines.append(common.table(
            ["GPUs", "ms / step", "images/s", "speed-up", "peak GiB"],
            [[1, res.get("flux_1gpu_ms_per_step"), res.get("flux_1gpu_images_per_s"), 1.0,
              res.get("flux_1gpu_peak_GiB")],
             [n, res.get(f"flux_{n}gpu_ms_per_step"), res.get(f"flux_{n}gpu_images_per_s"),
              res.get(f"flux_speedup_{n}gpu"), res.get(f"flux_{n}gpu_peak_GiB")]],
            title=f"\nFlux-dev LoRA r16 training at {a.flux_size}^2, batch 1 per GPU, checkpointing "
                  f"{'on' if a.ckpt else 'off'}, {'CUDA graph' if a.graph else 'eager'}"))
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--sizes-mib", default="1,4,16,64,256,1024",
                    type=lambda s: [int(v) if float(v).is_integer() else float(v) for v in s.split(",")])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--flux-size", type=int, default=1024)
    ap.add_argument("--flux-steps", type=int, default=5, help="steps per timed interval (3 intervals)")
    ap.add_argument("--no-graph", dest="graph", action="store_false")
    ap.add_argument("--no-ckpt", dest="ckpt", action="store_false")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-flux", action="store_true")
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--torch-port", type=int, default=29517)
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per worker launch")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main():
    a = parse()
    if a.worker:
        WORKERS[a.worker](a)
        return 0
    res = common.Results("ddp")
    res.log("gpus", a.gpus)
    with tempfile.TemporaryDirectory() as tmp:
        parts = [] if a.skip_allreduce else [("all-reduce", lambda: allreduce_part(res, a, tmp))]
        if not a.skip_flux:
            parts.append(("Flux-dev LoRA throughput", lambda: flux_part(res, a, tmp)))
        failed = common.run_parts(res, parts)
    print(report(res, a), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
