"""The step's parts on the cpu, with stand-ins: the CUDA graph part (StepGraphs.step) falls back to an eager step
and tells the streaming part at its named points; StreamedBlocks drives a BlockStreamer stand-in."""
import pytest

from flame_core.errors import OutOfMemoryError
from flame_models.training import graphs
from flame_models.training.streaming import MAX_DEMOTIONS, NoStreaming, StreamedBlocks


class _Capture:
    """A GraphedFunction stand-in: eager for `warmup` calls, then the capture raises `error` once, then 'captures'."""
    error = None

    def __init__(self, fn, warmup=2):
        self.fn, self.warmup, self.calls, self.graph = fn, warmup, 0, None

    def __call__(self, *args):
        self.calls += 1
        if self.calls > self.warmup and self.graph is None:
            if _Capture.error is not None:
                e, _Capture.error = _Capture.error, None
                raise e
            self.graph = "captured"
        return self.fn(*args)

    def reset(self):
        self.graph = None


class _Streamer:
    def __init__(self):
        self.generation, self.resident, self.calls = 0, [0, 1, 2], []

    def prime(self):
        self.calls.append("prime")

    def join(self):
        self.calls.append("join")

    def invalidate_slots(self):
        self.calls.append("invalidate")


def test_a_capture_over_the_budget_demotes_blocks_and_captures_at_the_next_step(monkeypatch):
    monkeypatch.setattr(graphs, "graphed", _Capture)
    monkeypatch.setattr(graphs.gc, "collect", lambda: None)
    demoted = []
    monkeypatch.setattr("flame_nn.offload.demote", lambda s: demoted.append(s.resident.pop()) or [demoted[-1]])
    streamer, logs = _Streamer(), []
    part = StreamedBlocks(streamer, "cpu")
    g = graphs.StepGraphs(lambda x: x * 2, warmup=1)
    run = lambda: g.step((3,), lambda x: -x, part, log=logs.append)  # noqa: E731  (eager: -x, told apart)
    assert run() == 6                                    # warm-up, eager inside the graph function
    _Capture.error = OutOfMemoryError("over the budget")
    assert run() == -3                                   # the failed capture: the eager step instead
    assert streamer.calls == ["invalidate", "prime"] and part.demotions == 1 and demoted == [2]
    assert g.enabled and g.failure == "OutOfMemoryError: over the budget"
    assert logs == ["CUDA graph capture did not fit the memory budget (OutOfMemoryError: over the budget); 1 more "
                    "blocks streamed (2 resident), capturing again next step"]
    assert run() == 6 and g.graph == "captured" and part.captured_with == 0   # captured at the next step
    streamer.generation = 1                              # blocks placed anew: the graph goes before the next step
    part.before_micro_step(g)
    assert g.graph is None and part.captured_with is None


def test_other_failures_train_on_eagerly_and_several_ranks_stop(monkeypatch):
    monkeypatch.setattr(graphs, "graphed", _Capture)
    logs = []
    g = graphs.StepGraphs(lambda x: x * 2, warmup=1)
    g.step((1,), lambda x: -x, NoStreaming(), log=logs.append)
    _Capture.error = RuntimeError("no capture here\nsecond line")
    assert g.step((1,), lambda x: -x, NoStreaming(), log=logs.append) == -1
    assert not g.enabled and logs == ["CUDA graph capture failed (RuntimeError: no capture here); training "
                                      "continues eagerly"]
    g = graphs.StepGraphs(lambda x: x * 2, warmup=1)
    g.step((1,), lambda x: -x, NoStreaming())
    _Capture.error = RuntimeError("no capture here")
    with pytest.raises(RuntimeError, match="rank 1: CUDA graph capture of the training step failed"):
        g.step((1,), lambda x: -x, NoStreaming(), rank=1, world_size=2)


def test_demotions_stop_after_the_limit(monkeypatch):
    monkeypatch.setattr("flame_nn.offload.demote", lambda s: [0])
    part = StreamedBlocks(_Streamer(), "cpu")
    said = [part.capture_failed(True) for _ in range(MAX_DEMOTIONS + 1)]
    assert all(said[:MAX_DEMOTIONS]) and said[-1] is None and part.demotions == MAX_DEMOTIONS
    assert part.capture_failed(False) is None        # only a capture over the budget demotes


class _Memory:
    """flame.memory stand-in on a 'cuda' device: a pool of `reserved` bytes under `limit`, freeing what demotions
    and empty_cache release."""

    def __init__(self, reserved, limit, cached=0, per_block=0):
        self.reserved, self.limit, self.cached, self.per_block = reserved, limit, cached, per_block

    def get_memory_limit(self, dev):
        return self.limit

    def set_memory_limit(self, n, dev):
        self.limit = n

    def memory_reserved(self, dev):
        return self.reserved

    def empty_cache(self, dev):
        self.reserved -= self.cached
        self.cached = 0


def _cuda_part(monkeypatch, mem, used):
    """StreamedBlocks under a 1000-byte budget on a stand-in cuda device whose driver reports `used()` bytes."""
    from flame_models.training import streaming

    class Dev:
        type = "cuda"
    from flame_nn.offload import autofit
    monkeypatch.setattr(streaming.flame, "device", lambda d: Dev())
    monkeypatch.setattr(autofit, "M", mem)
    monkeypatch.setattr(autofit, "outside_pool", lambda dev: max(0, used() - mem.reserved))
    demoted = []

    def demote(s):
        if not s.resident:
            return []
        demoted.append(s.resident.pop())
        mem.cached += mem.per_block
        return [demoted[-1]]
    monkeypatch.setattr(autofit, "demote", demote)
    monkeypatch.setattr("flame_nn.offload.demote", demote)
    return StreamedBlocks(_Streamer(), "cuda", budget=1000), demoted


class _Graphs:
    graph = "captured"

    def __init__(self):
        self.graphs = {"shape": _Capture(lambda x: x, warmup=2)}
        self.graphs["shape"].calls = 5

    def reset(self):
        self.graph = None
        for g in self.graphs.values():
            g.reset()
            g.calls = 0


def test_growth_outside_the_pool_after_a_capture_lowers_the_limit(monkeypatch):
    mem = _Memory(reserved=800, limit=900)          # 100 bytes outside at the fit: limit + outside = budget
    part, demoted = _cuda_part(monkeypatch, mem, lambda: mem.reserved + 130)   # the capture: 30 more outside
    said = part.after_graph_step(_Graphs())
    assert mem.limit == 870 and demoted == [] and part.captured_with == 0
    assert said == "130 B outside FLAME's pool after the CUDA graph capture: the pool's limit lowered by 30 B " \
                   "to keep max_gpu_memory"
    assert part.after_graph_step(_Graphs()) is None   # only right after a capture


def test_a_pool_over_its_lowered_limit_demotes_blocks(monkeypatch):
    mem = _Memory(reserved=900, limit=900, per_block=40)
    part, demoted = _cuda_part(monkeypatch, mem, lambda: mem.reserved + 150)   # 50 over the budget
    graphs_ = _Graphs()
    said = part.after_graph_step(graphs_)
    assert mem.limit == 850 and demoted == [2, 1] and mem.reserved == 820 and part.demotions == 2
    assert said.endswith("2 more blocks streamed (1 resident), capturing again next step")
    # the graph captured with the old placement is gone; the next call captures (no eager warm-up again)
    assert graphs_.graph is None and part.captured_with is None and graphs_.graphs["shape"].calls == 2


def test_growth_beyond_a_quarter_of_the_limit_is_said_and_left_alone(monkeypatch):
    mem = _Memory(reserved=800, limit=900)
    part, demoted = _cuda_part(monkeypatch, mem, lambda: mem.reserved + 100 + 300)   # 300 past the budget
    said = part.after_graph_step(_Graphs())
    assert mem.limit == 900 and demoted == [] and "another process on the device?" in said


def test_within_the_budget_nothing_changes(monkeypatch):
    mem = _Memory(reserved=700, limit=900)
    part, demoted = _cuda_part(monkeypatch, mem, lambda: mem.reserved + 100)
    assert part.after_graph_step(_Graphs()) is None and mem.limit == 900 and demoted == []
