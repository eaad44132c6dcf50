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
