"""NCCL collectives captured in a CUDA graph and replayed (one rank on one GPU, two ranks on two), through the
launcher: synchronous and asynchronous forms between compute on the capturing stream, then an eager collective;
closing the group while the graph lives releases the graph (ncclCommDestroy would wait for it forever)."""
import json

import pytest

import flame_core as flame

from .test_gpu_ddp import launch


def gpus():
    return flame.cuda_device_count() if flame.cuda_is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_captured_collectives_replay_right(tmp_path, world):
    if gpus() < world:
        pytest.skip(f"needs {world} CUDA GPU(s)")
    launch(world, "gpu_capture.py", str(tmp_path / "c"), via_launcher=True)
    for rank in range(world):
        res = json.load(open(tmp_path / f"c.rank{rank}.json"))
        assert "exception" not in res, res["exception"]
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, (rank, bad)
        assert {"replayed_x", "replayed_y", "eager_after", "graph_released_at_close"} <= set(res)
