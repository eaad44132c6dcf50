"""Data-parallel training over several processes: process groups, collectives on FLAME tensors, the TCP store, a
launcher (`python -m flame_core.distributed.run --nproc-per-node N script.py ...`). Mirrors torch.distributed:

    import flame_core.distributed as dist
    dist.init_process_group()                      # "nccl" on GPUs, "store" on the cpu; from the environment
    t = flame.ones(4, device=flame.default_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)       # every rank: t == world_size
    dist.barrier(); dist.destroy_process_group()

flame_nn.parallel.DistributedDataParallel all-reduces gradients on top of this. docs/DISTRIBUTED.md tells how to
launch (this launcher, torchrun, srun) and what a run across machines needs.
"""
from .base import ReduceOp, Work
from .collectives import (
                          all_gather,
                          all_gather_into_tensor,
                          all_reduce,
                          broadcast,
                          reduce_scatter,
                          reduce_scatter_tensor,
)
from .env import DistEnv, DistributedError, read_env, world_from_env
from .group import (
                          ProcessGroup,
                          barrier,
                          default_group,
                          destroy_process_group,
                          get_backend,
                          get_rank,
                          get_world_size,
                          init_process_group,
                          is_available,
                          is_initialized,
                          is_nccl_available,
)
from .store import StoreError, StoreTimeoutError, TCPStore

__all__ = ["ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter",
           "reduce_scatter_tensor", "DistEnv", "DistributedError", "read_env", "world_from_env", "ProcessGroup",
           "barrier", "default_group", "destroy_process_group", "get_backend", "get_rank", "get_world_size",
           "init_process_group", "is_available", "is_initialized", "is_nccl_available", "StoreError",
           "StoreTimeoutError", "TCPStore"]
