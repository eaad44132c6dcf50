"""Training steps replayed as CUDA graphs, one graph per batch shape.

Every batch comes from one aspect bucket, so a run has as many batch shapes as buckets it draws from. A captured
graph replays one shape only, and keeps its own copy of a step's activations (memory private to the graph) for as
long as it lives. So: one graph per shape when the run draws from at most MAX_SHAPES shapes -- at most ONE under
max_gpu_memory, where auto-fit sized the resident blocks for a single step's activations -- and eager steps
otherwise: graphs for many buckets would multiply that memory, and a shape seen rarely would not earn back its
capture. Single-resolution square datasets (the common case) and the synthetic / precomputed data have one shape.
"""
import gc
import os
import traceback

from flame_core.cuda import graphed
from flame_core.errors import OutOfMemoryError

MAX_SHAPES = 3


def graph_plan(num_shapes, budget, enabled, cuda, draws=None, layerwise=False, streamed_prior=False):
    """(use graphs?, why not) for a run with `num_shapes` batch shapes. draws: what draws random numbers inside the
    step (the adapters' dropouts), in words, or None: a graph would replay one draw at every step. layerwise: blocks
    updated inside backward (a full fine-tune under max_gpu_memory), whose host round trips a graph cannot hold.
    streamed_prior: a forward without gradients through streamed blocks -- output preservation's, or a prior_reg
    dataset's -- (an inference schedule: its window wraps to the next call, which a replay would not start from)."""
    if not enabled or not cuda:
        return False, None
    if layerwise:
        return False, ("max_gpu_memory with network.type full: each block is updated inside backward (host round "
                       "trips a CUDA graph cannot hold): training runs eagerly")
    if streamed_prior:
        return False, ("output preservation (or a prior_reg dataset) under max_gpu_memory: its prior prediction "
                       "streams the blocks as an inference forward, which a CUDA graph cannot replay: training runs "
                       "eagerly")
    if draws:
        return False, (f"{draws} draw random numbers inside the step, which a CUDA graph would replay unchanged: "
                       f"training runs eagerly")
    limit = 1 if budget is not None else MAX_SHAPES
    if num_shapes > limit:
        return False, (f"{num_shapes} batch shapes (aspect buckets) exceed {limit} CUDA graph"
                       f"{'s' if limit > 1 else ''}" + (" under max_gpu_memory" if budget is not None else "")
                       + ": each graph keeps a step's activations; training runs eagerly")
    return True, None


class StepGraphs:
    """A GraphedFunction of `fn` per argument-shape signature (eager for the first `warmup` calls of each): the CUDA
    graph part of the training step (`step`). `failure`: why the last capture that failed did (the exception's type
    and first line), or None; `failure_at`: the innermost frames it was raised in."""

    def __init__(self, fn, warmup=2):
        self.fn, self.warmup = fn, int(warmup)
        self.enabled = True
        self.graphs = {}
        self.failure = None
        self.failure_at = None   # where the failure was raised: the innermost frames, as text

    @property
    def why(self):
        """The last failed capture's exception and where it was raised, in words (None: none failed)."""
        return None if self.failure is None else f"{self.failure} ({self.failure_at})"

    @staticmethod
    def key(args):
        return tuple((tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else a for a in args)

    def for_args(self, args):
        k = self.key(args)
        g = self.graphs.get(k)
        if g is None:
            g = self.graphs[k] = graphed(self.fn, warmup=self.warmup)
        return g

    @property
    def graph(self):
        """A captured graph (the first), or None: whether any shape was captured."""
        return next((g.graph for g in self.graphs.values() if g.graph is not None), None)

    @property
    def captured(self):
        return sum(g.graph is not None for g in self.graphs.values())

    def reset(self):
        for g in self.graphs.values():
            g.reset()

    def step(self, args, eager, streaming, rank=0, world_size=1, log=print):
        """One forward + backward through this shape's graph (eager while it warms up). A capture that fails falls
        back to `eager(*args)`, said once through `log`: after a capture over the budget `streaming` (the step's
        streaming part) may demote blocks and the next step captures again, otherwise the run trains eagerly from
        here. With several ranks a failed capture stops the run. Returns the loss."""
        g = self.for_args(args)  # this batch shape's graph
        failed = None
        try:
            loss = g(*args)
        except Exception as e:  # noqa: BLE001 - a capture that fails falls back to eager steps, said once
            if g.graph is not None or g.calls <= g.warmup:
                raise
            # the message and where it was raised, as text: the exception's frames hold the failed capture's tensors
            where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                for f in reversed(traceback.extract_tb(e.__traceback__)[-10:]))
            failed = (isinstance(e, OutOfMemoryError), f"{type(e).__name__}: {str(e).splitlines()[0]}",
                      f"at {where}")
        if failed is not None:
            self.failure, self.failure_at = failed[1], failed[2]
            if world_size > 1:
                # the collectives this rank queued in the failed capture never ran, and another rank may have
                # captured fine: the ranks' collectives would no longer pair up, so stop (the launcher stops all)
                raise RuntimeError(f"rank {rank}: CUDA graph capture of the training step failed ({failed[1]}); "
                                   f"with several ranks a rank cannot fall back to eager steps on its own -- set "
                                   f"train.cuda_graph: false to train eagerly")
            gc.collect()
            demoted = streaming.capture_failed(failed[0])
            if demoted:
                self.reset()
                g.calls = g.warmup  # capture again at the next step of this shape
                log(f"CUDA graph capture did not fit the memory budget ({failed[1]}); {demoted}, capturing again "
                    f"next step")
            else:
                self.enabled = False
                log(f"CUDA graph capture failed ({failed[1]}); training continues eagerly")
            streaming.before_micro_step(None)  # the slots primed again for the eager step instead
            loss = eager(*args)
        said = streaming.after_graph_step(self)
        if said:
            log(said)
        return loss
