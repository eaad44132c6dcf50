"""Non-finite training on the GPU: the loss's flag is updated inside the captured CUDA graph, so a poisoned sample
that arrives after the capture is still caught, naming its step and file."""
import pytest

from flame_models.training import checkpoint as ckpt
from flame_models.training.finite import NonFiniteError
from flame_models.training.trainer import Trainer

from .test_finite import _config, _poisoned_samples

pytestmark = pytest.mark.gpu


def test_a_nan_loss_inside_the_captured_graph_stops_the_run(tmp_path):
    data, bad = _poisoned_samples(tmp_path / "data")               # sample 6: in step 4's batch
    c = _config(tmp_path, "g", data)
    c.device, c.train.dtype, c.model.dtype, c.train.cuda_graph = "cuda", "bf16", "bf16", True
    tr = Trainer(c, verbose=False)
    with pytest.raises(NonFiniteError) as ei:
        tr.train()
    # steps 1-2 eager, 3 captured, 4 replayed
    assert tr.graphed is not None and tr.graphed.captured == 1, tr.graphed.why
    msg = str(ei.value)
    assert msg.startswith("step 4: the loss") and bad in msg, msg
    assert ckpt.checkpoint_steps(c.output_dir) == [2, 3]
