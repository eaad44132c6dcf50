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
        """After a capture: flame_nn.offload.fit_outside_growth (the pool's limit lowered by the growth outside it,
        blocks demoted while the pool holds more; the graphs go and the next step captures again, with no eager
        warm-up). Returns what was done, in words, or None."""
        fit = flame_nn.offload.fit_outside_growth(self.streamer, self.budget, flame.device(self.device),
                                                  MAX_DEMOTIONS - self.demotions)
        if not fit:
            return None
        if fit.demoted:  # the graphs were captured with the old placement: capture again at the next step
            self.demotions += fit.rounds
            graphs.reset()
            for g in graphs.graphs.values():
                g.calls = g.warmup
            self.captured_with = None
        return fit.words() + (f" ({len(self.streamer.resident)} resident), capturing again next step"
                              if fit.demoted else "")

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

