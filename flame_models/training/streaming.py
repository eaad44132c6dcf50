"""Streamed blocks (max_gpu_memory) as a part of the training step: what the step asks of the BlockStreamer at its
named points. A run without a budget holds `NoStreaming`, whose points do nothing, so the step itself has no
streaming branches.

    before_micro_step(graphs)   the slots as every step starts (and ends): sampling or an evaluation in between may
                                have moved them, and a replayed step assumes them; graphs captured with an earlier
                                placement of the blocks (set_resident) are dropped
    after_backward()            in a capture, the copy stream's branch joins back before the capture ends
    after_graph_step(graphs)    remembers the placement a graph was captured with; after a capture under a budget,
                                what grew outside the pool (the graph's executable, kernels its replay loaded) comes
                                off the pool's limit, demoting blocks where the pool holds more
    capture_failed(oom)         the failed capture's recorded loads never ran: the slots are invalid; a capture over
                                the budget demotes resident blocks (at most MAX_DEMOTIONS times)
    before_sample(graphs)       a captured step holds its activations' memory: sampling needs that room
"""
import flame_core as flame
import flame_nn
from flame_core.memory.stats import fmt_bytes
from flame_nn.offload.autofit import outside_pool

MAX_DEMOTIONS = 3  # captures over the budget answered by streaming more blocks, before a run trains eagerly


class NoStreaming:
    """Every block resident: nothing to do at any point of the step."""
    streamer = None
    demotions = 0

    def before_micro_step(self, graphs):
        pass

    def after_backward(self):
        pass

    def after_graph_step(self, graphs):
        """None, or what was done to keep a new capture within the budget, in words."""
        return None

    def capture_failed(self, out_of_memory):
        """None: no blocks to demote."""
        return None

    def before_sample(self, graphs):
        pass


class StreamedBlocks(NoStreaming):
    """The step's side of a flame_nn.offload.BlockStreamer on `device`."""

    def __init__(self, streamer, device, budget=None):
        self.streamer, self.device, self.budget = streamer, device, budget  # budget: max_gpu_memory in bytes
        self.captured_with = None  # the streamer's placement (generation) the graphs were captured with
        self.demotions = 0

    def before_micro_step(self, graphs):
        if graphs is not None and graphs.graph is not None and self.captured_with != self.streamer.generation:
            graphs.reset()  # the blocks were placed anew (set_resident): the captured slots are gone
            self.captured_with = None
        self.streamer.prime()

    def after_backward(self):
        self.streamer.join()

    def after_graph_step(self, graphs):
        if graphs.graph is not None and self.captured_with is None:
            self.captured_with = self.streamer.generation
            return self._fit_outside_growth(graphs)
        return None

    def _fit_outside_growth(self, graphs):
        """After a capture: the device memory outside FLAME's pool grew (the graph's executable, kernels and
        library workspaces its first replay loaded) past what auto_fit measured. The pool's limit comes down by
        what the limit plus that memory now exceed the budget; while the pool holds more than its new limit, blocks
        are demoted (at most MAX_DEMOTIONS times; the graphs go and the next step captures again, with no eager
        warm-up). A growth of more than a quarter of the pool's limit is not this process's graph (another process
        on the device): it is said and left alone. Returns what was done, in words, or None."""
        dev = flame.device(self.device)
        if self.budget is None or dev.type != "cuda":
            return None
        M = flame.memory
        limit = M.get_memory_limit(dev)
        if limit is None:
            return None
        outside = outside_pool(dev)
        over = limit + outside - self.budget
        if over <= 0:
            return None
        if over > limit // 4:
            return (f"{fmt_bytes(outside)} in use outside FLAME's pool after the CUDA graph capture, "
                    f"{fmt_bytes(over)} past max_gpu_memory: more than this process's graph adds (another process on "
                    f"the device?); the budget cannot be kept from here")
        M.set_memory_limit(limit - over, dev)
        M.empty_cache(dev)
        gone = []
        while M.memory_reserved(dev) > limit - over and self.demotions < MAX_DEMOTIONS:
            got = flame_nn.offload.demote(self.streamer)
            if not got:
                break
            gone += got
            self.demotions += 1
            M.empty_cache(dev)
        if gone:  # the graphs were captured with the old placement: capture again at the next step
            graphs.reset()
            for g in graphs.graphs.values():
                g.calls = g.warmup
            self.captured_with = None
        return (f"{fmt_bytes(outside)} outside FLAME's pool after the CUDA graph capture: the pool's limit lowered by "
                f"{fmt_bytes(over)} to keep max_gpu_memory" + (f"; {len(gone)} more blocks streamed "
                                                          f"({len(self.streamer.resident)} resident), capturing "
                                                          f"again next step" if gone else ""))

    def capture_failed(self, out_of_memory):
        """Invalidate the slots; on an out-of-memory capture demote resident blocks (a graph needs a little more
        than an eager step). Returns what was demoted, in words, or None when nothing was."""
        self.streamer.invalidate_slots()
        gone = []
        if out_of_memory and self.demotions < MAX_DEMOTIONS:
            gone = flame_nn.offload.demote(self.streamer)
        if not gone:
            return None
        self.demotions += 1
        return f"{len(gone)} more blocks streamed ({len(self.streamer.resident)} resident)"

    def before_sample(self, graphs):
        if graphs is not None and graphs.captured:
            # under max_gpu_memory a step's graph holds its activations' memory (private to the graph) while it
            # lives; sampling needs that room: the graphs go, and the next steps capture them again
            graphs.reset()
            self.captured_with = None
            flame.memory.empty_cache(self.device)

