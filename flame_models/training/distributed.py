"""The trainer on several GPUs: what changes when it runs under a launcher with WORLD_SIZE > 1.

    python -m flame_core.distributed.run --nproc-per-node 2 examples/train_flux_lora.py --config my.yaml
    (or torchrun / srun: docs/DISTRIBUTED.md)

The Trainer holds a `TrainerGroup` (`trainer.dist`); with one process every method below passes straight through,
so the trainer has one code path. With N ranks:
- each rank trains on cuda:LOCAL_RANK (the config's device is recorded as written, rank-independent);
- data: each rank takes its B rows of the global batch of N·B (flame_models.data.sharding); the timestep and noise
  draws are made for the whole global batch from the same generators on every rank, and each rank keeps its rows --
  so a step is the step one process with batch N·B would take (up to the reduction order of float sums);
- the trained parameters (adapters, or a full fine-tune's weights) are wrapped in
  flame_nn.parallel.DistributedDataParallel at the first optimizer step
  (after auto-fit's measured steps, which stay local): gradients are averaged while backward runs; with gradient
  accumulation the micro-steps accumulate locally (no_sync) and are averaged once after the last;
- the logged loss and timestep are the means over the ranks; a stop request (Ctrl-C / SIGTERM) on any rank stops
  every rank after the same step;
- logs, checkpoints, samples and LoRA files are written by rank 0 only (`on_main_rank`); the others wait at a
  barrier and get rank 0's return value;
- a checkpoint records the world size and global batch with the data position; it resumes under another world size
  when batch_size × ranks is the same (`comparable` compares the global batch instead of batch_size).
Dropout inside the model (network.dropout) draws on each rank from identical generators: the ranks' masks are
equal, not those of one process with the whole batch (resume stays exact).
"""
import contextlib
import copy
import functools
import json

import flame_core as flame
from flame_core import distributed as dist

from ..data import sharding

MAIN_FIRST_TIMEOUT = 24 * 3600.0  # seconds the other ranks wait for rank 0's caches


class TrainerGroup:
    """The trainer's side of the job. `is_main`, `rank`, `world_size` are known from the environment at once; the
    process group is joined in `join(device)`."""

    def __init__(self, rank=0, world_size=1):
        self.rank, self.world_size = int(rank), int(world_size)
        self.is_main = self.rank == 0
        self.group = None
        self.device = None
        self.ddp = None
        self._on_main_depth = 0
        self._calls = 0

    @classmethod
    def from_env(cls):
        found = dist.world_from_env()
        return cls(found[0], found[1]) if found is not None else cls()

    # ------------------------------------------------------------------ set-up
    def join(self, device):
        """This rank's device for the configured one (cuda -> cuda:LOCAL_RANK) after joining the process group
        ("nccl" for cuda, "store" for cpu)."""
        device = flame.device(device)
        if self.world_size == 1:
            return device
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "store")
        self.group = dist.default_group()
        if self.group.size() != self.world_size or self.group.rank() != self.rank:
            raise dist.DistributedError(f"the process group is rank {self.group.rank()} of {self.group.size()}, "
                                        f"the environment said {self.rank} of {self.world_size}")
        self.device = self.group.device if device.type == "cuda" else device
        if device.type == "cuda" and self.group.backend_name != "nccl":
            raise dist.DistributedError("training on cuda with several ranks needs the nccl backend")
        return self.device

    def shard_loader(self, loader):
        return sharding.shard_loader(loader, self.rank, self.world_size)

    def comparable(self, state, config):
        """(checkpoint's config, this config) as resume.compare should see them: with several ranks on either side
        the global batch (batch_size × world size) is compared instead of batch_size."""
        old = copy.deepcopy(state.get("config", {}))
        theirs = int((state.get("loader") or {}).get("world_size", 1))
        if theirs == 1 and self.world_size == 1:
            return old, config
        new = copy.deepcopy(config)
        for cfg, world in ((old, theirs), (new, self.world_size)):
            train = cfg.get("train")
            if isinstance(train, dict) and "batch_size" in train:
                train["global_batch_size"] = int(train.pop("batch_size")) * world
        return old, new

    # ------------------------------------------------------------------ one step
    def global_batch(self, batch_size):
        return batch_size * self.world_size

    def shard(self, t):
        """This rank's rows of a tensor drawn for the whole global batch."""
        if self.world_size == 1:
            return t
        b = t.shape[0] // self.world_size
        return t[self.rank * b:(self.rank + 1) * b].contiguous()

    def before_step(self, model, stop, parameters=None):
        """At each optimizer step: the trained parameters -- `parameters()`, [(name, Parameter)] (called once, at
        the wrapping: a full fine-tune's weights), default `model`'s adapters -- wrapped in DistributedDataParallel
        the first time; returns the stop request (None or the trainer's StopRequest) as the step should hold it:
        made collective (AgreedStop) with several ranks."""
        if self.world_size == 1:
            return stop
        if self.ddp is None:
            from flame_nn import adapters
            from flame_nn.parallel import DistributedDataParallel
            self.ddp = DistributedDataParallel(model, broadcast_buffers=False, process_group=self.group,
                                               parameters=parameters() if parameters is not None
                                               else adapters.named_adapter_parameters(model))
        return stop if stop is None or isinstance(stop, AgreedStop) else AgreedStop(stop)

    def accumulation(self, micro_steps):
        """Around a step's micro-steps: with several micro-steps, local accumulation then one average."""
        if self.world_size == 1 or micro_steps == 1 or self.ddp is None:
            return contextlib.nullcontext()
        return _Accumulate(self.ddp)

    def reduce_step(self, stop, loss, timestep):
        """The step's loss and timestep averaged over the ranks; every rank learns whether any asked to stop (`stop`,
        the AgreedStop before_step returned, is told)."""
        if self.world_size == 1:
            return float(loss), float(timestep)
        agreed, stop = stop, stop.inner.requested if isinstance(stop, AgreedStop) else None
        v = flame.tensor([float(loss), float(timestep), 1.0 if stop else 0.0], dtype=flame.float64,
                         device=self.device)
        dist.all_reduce(v, group=self.group)
        loss, timestep, stops = (float(x) for x in v.numpy())
        if isinstance(agreed, AgreedStop) and stops > 0:
            agreed.agreed = stop or "SIGTERM (on another rank)"
        return loss / self.world_size, timestep / self.world_size

    # ------------------------------------------------------------------ rank 0's work
    def run_on_main(self, fn, *args, **kwargs):
        """fn(...) on rank 0 while the others wait; every rank returns rank 0's result (JSON round trip). Nested
        calls (a checkpoint saving its LoRA) run inline."""
        if self.world_size == 1 or self._on_main_depth:
            return fn(*args, **kwargs)
        self._calls += 1
        key = f"trainer/on_main{self._calls}"
        result = None
        if self.is_main:
            self._on_main_depth += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                self._on_main_depth -= 1
            self.group.store.set(key, json.dumps(result, default=str))
        self.group.barrier()
        if self.is_main:
            if self._calls > 1:  # everyone passed this barrier, so everyone read the previous result
                self.group.store.delete_key(f"trainer/on_main{self._calls - 1}")
            return result
        return json.loads(self.group.store.get(key))


    def main_first(self, fn, *args, **kwargs):
        """fn(...) on rank 0, then -- after a barrier -- on the others; each rank returns its own result. For work
        whose files the others then reuse instead of redoing (the latent and text-embedding caches)."""
        if self.world_size == 1:
            return fn(*args, **kwargs)
        result = fn(*args, **kwargs) if self.is_main else None
        self.group.barrier(timeout=MAIN_FIRST_TIMEOUT)  # encoding a large dataset's caches takes long
        return result if self.is_main else fn(*args, **kwargs)


def on_main_rank(fn):
    """Decorator for Trainer methods that write files: rank 0 runs them, the others wait and get its result."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return self.dist.run_on_main(fn, self, *args, **kwargs)
    return wrapper


def main_rank_only(fn):
    """Decorator for Trainer methods that only rank 0 runs, without waiting (the loss log's rows)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs) if self.dist.is_main else None
    return wrapper


class AgreedStop:
    """The trainer's stop request as all ranks agree on it at the last step (reduce_step), so that every rank
    stops after the same step; `inner` is this rank's signal handler."""

    def __init__(self, inner):
        self.inner, self.agreed = inner, None

    @property
    def requested(self):
        return self.agreed


class _Accumulate:
    def __init__(self, ddp):
        self.ddp, self.ctx = ddp, ddp.no_sync()

    def __enter__(self):
        self.ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.ctx.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.ddp.all_reduce_gradients()
        return False
