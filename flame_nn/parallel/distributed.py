"""DistributedDataParallel: every rank trains the same model on its share of the batch; the gradients of the
trainable parameters are averaged over the ranks while backward runs (torch's DDP).

    dist.init_process_group()
    model = Flux(...); inject_adapters(model, ...)             # frozen base + trainable adapters, on this rank's GPU
    ddp = DistributedDataParallel(model)                       # rank 0's trainable parameters and buffers everywhere
    loss = loss_fn(ddp(x), y); loss.backward()                 # gradients averaged over the ranks when it returns
    opt.step()
    with ddp.no_sync():                                        # gradient accumulation: no communication ...
        loss_fn(ddp(x1), y1).backward()
    loss_fn(ddp(x2), y2).backward()                            # ... until the first backward outside it

Only parameters with requires_grad take part (a LoRA run averages only the adapters). Their gradients live in the
flat buffers of flame_core.grad_pool (registered here if the optimizer has not done it); buckets.py cuts those into
contiguous buckets, all-reduced in place with ReduceOp.AVG. Frozen parameters are not broadcast: every rank loads
them itself (streamed blocks have no GPU copy to send).

When a bucket is launched. A post-accumulate-grad hook on each parameter counts how many times backward accumulated
into its gradient. The first backward after construction only learns those counts -- gradient checkpointing
recomputes a region inside backward and accumulates again for each region a parameter is used in -- and all-reduces
every bucket at its end. From then on a parameter is final when it reached its count, a bucket is ready when all
its parameters are final, and ready buckets are launched strictly in bucket order (every rank issues the same
collectives in the same order) on the process group's communication stream, overlapping the rest of backward.
Buckets still waiting when backward ends (a parameter that got fewer gradients this time) are launched then. A
parameter that gets more gradients than it did in the first backward after its bucket left is an error (the
graph changed: the bucket was reduced early).

At the end of the outermost backward (flame_core.autograd.queue_callback) the caller's stream waits for the
communication stream, and a parameter whose `.grad` is still None (unused on this rank) gets its pooled gradient,
which now holds the average: every rank's optimizer then steps the same parameters. The hook path is host-only
Python with no synchronisation, so a captured CUDA graph of forward + backward contains the all-reduces (the
decisions -- which bucket, in which order -- are taken at capture; a capture under no_sync() holds none).
"""
import contextlib
import hashlib
import weakref

import flame_core as flame
from flame_core import autograd, grad_pool
from flame_core import distributed as dist

from ..module import Module
from .buckets import FIRST_BUCKET_BYTES, plan_buckets


class DDPError(dist.DistributedError):
    """A model or a backward DistributedDataParallel cannot handle (the message names the parameter)."""


def _signature(names, params):
    h = hashlib.sha256()
    for n, p in zip(names, params):
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype};".encode())
    return int.from_bytes(h.digest()[:7], "little")


class DistributedDataParallel(Module):
    def __init__(self, module, device_ids=None, broadcast_buffers=True, process_group=None, bucket_cap_mb=25.0,
                 parameters=None):
        """parameters: the parameters to average -- Tensors or (name, Tensor) pairs -- when they are not all
        registered in `module` (adapters injected by flame_nn.adapters are not: pass
        `adapters.named_adapter_parameters(model)`); default: `module`'s parameters that require grad."""
        super().__init__()
        self.module = module
        g = process_group if process_group is not None else dist.default_group()
        self.process_group, self.broadcast_buffers = g, bool(broadcast_buffers)
        self.world_size, self.rank = g.size(), g.rank()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_cap_mb = float(bucket_cap_mb)
        named, seen = [], set()
        given = module.named_parameters() if parameters is None else \
            [q if isinstance(q, tuple) else (f"parameters[{k}]", q) for k, q in enumerate(parameters)]
        for n, p in given:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((n, p))
        if not named:
            raise DDPError(f"DistributedDataParallel: {type(module).__name__} has no parameter that requires grad"
                           + ("" if parameters is None else " among the `parameters` given")
                           + " (adapters are not module parameters: pass parameters=named_adapter_parameters(model))")
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._check_devices(g, device_ids)
        grad_pool.register(self.params)
        for n, p in named:
            if not grad_pool.is_registered(p):
                raise DDPError(f"parameter {n} ({tuple(p.shape)}, {p.dtype}) cannot take a pooled gradient (not a "
                               f"leaf?); DDP reduces the flat gradient buffers of flame_core.grad_pool")
        self._buffers_synced = [b for b in module.buffers()] if self.broadcast_buffers else []
        for b in self._buffers_synced:
            if b.device != g.device and g.backend_name == "nccl" or not b.is_contiguous():
                raise DDPError(f"a buffer of shape {tuple(b.shape)} on {b.device} cannot be broadcast by the "
                               f"{g.backend_name} group (on {g.device}); move it or pass broadcast_buffers=False")
        self._verify_same_model()
        with flame.no_grad():
            for p in self.params:
                dist.broadcast(p, src=0, group=g)
            self._sync_buffers()

        cap = int(self.bucket_cap_mb * 2 ** 20)
        self.buckets = plan_buckets(self.params, cap, min(cap, FIRST_BUCKET_BYTES))
        self._bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self.require_backward_grad_sync = True
        self.expected = None               # gradients per parameter per backward, learned from the first one
        self._pass = None                  # engine pass the per-backward state below belongs to
        # what happened so far: backward passes that synchronised, buckets launched while backward still ran
        # (overlapped with it) and at its end
        self.stats = {"synced_passes": 0, "buckets_overlapped": 0, "buckets_at_end": 0}
        self._handles = []
        me = weakref.ref(self)
        for i, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(_Hook(me, i)))

    # ------------------------------------------------------------------ construction checks
    def _check_devices(self, g, device_ids):
        devs = {str(p.device) for p in self.params}
        if len(devs) > 1:
            raise DDPError(f"the trainable parameters sit on several devices ({sorted(devs)}); DDP wants them all "
                           f"on this rank's device")
        dev = self.params[0].device
        if g.backend_name == "nccl" and dev != g.device:
            raise DDPError(f"the trainable parameters are on {dev}, this rank's NCCL group on {g.device} "
                           f"(LOCAL_RANK); build the model on flame.default_device()")
        if device_ids is not None:
            ids = list(device_ids)
            if len(ids) != 1 or dev.type != "cuda" or int(ids[0]) != dev.index:
                raise DDPError(f"device_ids={ids} but the parameters are on {dev} (one device per process)")

    def _verify_same_model(self):
        """Every rank must hold the same trainable parameters (names, shapes, dtypes), or the buckets would not
        line up and the collectives would hang."""
        g = self.process_group
        dev = self.params[0].device
        mine = flame.tensor([len(self.params), _signature(self.param_names, self.params)], dtype=flame.int64,
                            device=dev)
        every = flame.zeros(2 * self.world_size, dtype=flame.int64, device=dev)
        dist.all_gather_into_tensor(every, mine, group=g)
        rows = every.numpy().reshape(self.world_size, 2)
        bad = [r for r in range(self.world_size) if tuple(rows[r]) != tuple(rows[self.rank])]
        if bad:
            raise DDPError(f"rank {self.rank}: ranks {bad} hold other trainable parameters (counts "
                           f"{rows[:, 0].tolist()}, or other names / shapes / dtypes); every rank must build the "
                           f"same model and adapters")

    def _sync_buffers(self):
        with flame.no_grad():
            for b in self._buffers_synced:
                dist.broadcast(b, src=0, group=self.process_group)

    # ------------------------------------------------------------------ the module
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self._buffers_synced and self.world_size > 1:
            self._sync_buffers()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates locally without communication; the first backward after it averages the
        accumulated gradients."""
        prev = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = prev

    def all_reduce_gradients(self):
        """Average every bucket now, outside backward (after backward passes under no_sync()); the caller's stream
        is ordered after it."""
        works = [dist.all_reduce(b.view, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)
                 for b in self.buckets]
        for w in works:
            w.wait()
        self._materialize(range(len(self.params)))

    # ------------------------------------------------------------------ backward
    def _begin_pass(self, pass_id):
        self._pass = pass_id
        self._sync = self.require_backward_grad_sync and self.world_size > 1
        self._fired = [0] * len(self.params)
        self._works = []
        self._next = 0
        self._launched = [False] * len(self.buckets)
        self._late = [False] * len(self.buckets)  # a parameter exceeded its count: wait for the end of backward
        if self.expected is not None:
            self._pending = [sum(1 for i in b.params if self.expected[i] > 0) for b in self.buckets]
        autograd.queue_callback(self._end_pass)

    def _on_grad(self, i):
        pass_id = autograd.current_pass()
        if pass_id != self._pass:
            self._begin_pass(pass_id)
        p = self.params[i]
        if p.grad is not grad_pool.pooled_grad(p):
            raise DDPError(f"{self.param_names[i]}: its .grad is not the pooled gradient (was .grad replaced by "
                           f"another tensor?); DDP averages the flat gradient buffers")
        self._fired[i] += 1
        if self.expected is None or not self._sync:
            return
        b = self._bucket_of[i]
        n, want = self._fired[i], self.expected[i]
        if n == want:
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._launch_ready()
        elif n > want:
            if self._launched[b]:
                raise DDPError(f"{self.param_names[i]} received gradient number {n} in this backward, after its "
                               f"bucket was all-reduced (the first backward gave it {want}): the graph changed "
                               f"since then; build the DDP after a representative step or keep the graph fixed")
            self._late[b] = True

    def _ready(self, b):
        return self._pending[b] == 0 and not self._late[b]

    def _launch_ready(self):
        while self._next < len(self.buckets) and self._ready(self._next):
            self._launch(self._next)
            self.stats["buckets_overlapped"] += 1

    def _launch(self, b):
        bucket = self.buckets[b]
        self._works.append(dist.all_reduce(bucket.view, op=dist.ReduceOp.AVG, group=self.process_group,
                                           async_op=True))
        self._launched[b] = True
        self._next = b + 1

    def _end_pass(self):
        if self.expected is None:
            self.expected = list(self._fired)
        elif any(self._late):
            self.expected = [max(e, f) for e, f in zip(self.expected, self._fired)]
        if self._sync:
            self.stats["synced_passes"] += 1
            for b in range(self._next, len(self.buckets)):
                self._launch(b)
                self.stats["buckets_at_end"] += 1
            for w in self._works:
                w.wait()
            self._materialize(range(len(self.params)))
        self._works = []
        self._pass = None

    def _materialize(self, indices):
        for i in indices:
            p = self.params[i]
            if p.grad is None:
                p.grad = grad_pool.pooled_grad(p)

    def extra_repr(self):
        return (f"world_size={self.world_size}, buckets={len(self.buckets)}, bucket_cap_mb={self.bucket_cap_mb:g}, "
                f"params={len(self.params)}")


class _Hook:
    """The per-parameter hook: holds the DDP weakly (a dropped DDP leaves inert hooks, not a live object)."""

    __slots__ = ("ddp", "i")

    def __init__(self, ddp_ref, i):
        self.ddp, self.i = ddp_ref, i

    def __call__(self, param):
        d = self.ddp()
        if d is not None:
            d._on_grad(self.i)


__all__ = ["DistributedDataParallel", "DDPError"]
