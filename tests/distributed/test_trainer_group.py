"""The trainer's TrainerGroup in one process: a plain run passes everything through; the resume comparison sees
the global batch when either side ran on several ranks."""
import flame_core as flame
from flame_models.training.distributed import TrainerGroup
from flame_models.training.resume import compare


def _cfg(batch):
    return {"train": {"batch_size": batch, "lr": 1e-4}, "device": "cuda:0"}


def test_one_process_passes_everything_through(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(k, raising=False)
    g = TrainerGroup.from_env()
    assert (g.rank, g.world_size, g.is_main) == (0, 1, True)
    assert g.join("cpu") == flame.device("cpu") and g.group is None
    t = flame.arange(6)
    assert g.shard(t) is t and g.global_batch(3) == 3
    assert g.shard_loader("loader") == "loader"
    assert g.run_on_main(lambda x: x + 1, 1) == 2 and g.main_first(lambda: "mine") == "mine"
    assert g.reduce_step(None, 2.5, 0.25) == (2.5, 0.25)
    with g.accumulation(4):
        pass
    old = _cfg(2)
    assert g.comparable({"config": old}, _cfg(2)) == (old, _cfg(2))


def test_resume_comparison_uses_the_global_batch_across_world_sizes():
    two = TrainerGroup(rank=1, world_size=2)
    assert two.is_main is False and two.global_batch(3) == 6
    state = {"config": _cfg(4), "loader": {"epoch": 0, "index": 8}}  # one process, batch 4
    assert compare(*two.comparable(state, _cfg(2))) == ([], [])      # 2 ranks x 2: the same global batch
    breaking, _ = compare(*two.comparable(state, _cfg(1)))
    assert breaking == [("train.global_batch_size", 4, 2)]
    one = TrainerGroup()
    state = {"config": _cfg(1), "loader": {"epoch": 0, "index": 8, "world_size": 4, "global_batch": 4}}
    assert compare(*one.comparable(state, _cfg(4))) == ([], [])       # 4 ranks x 1 resumed by one process x 4
    assert compare(*one.comparable(state, _cfg(1)))[0] == [("train.global_batch_size", 4, 1)]
    assert state["config"]["train"]["batch_size"] == 1  # the checkpoint's own dict is left as it was
