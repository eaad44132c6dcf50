"""logging: TensorBoard event files read back with TensorBoard's own reader (the run's loss rows, lr per group, grad
norm, step time, sample images), a resumed run's events after the checkpoint replaced, not doubled; the config
section; a tracker asked for but not installed stops set-up with the package to install."""
import shutil
import sys
import time

import numpy as np
import pytest

from flame_models.training import checkpoint as ckpt
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _events(folder):
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_events_hold_the_loss_log_rows_and_more(tmp_path):
    c = tiny_config(tmp_path, "tb", steps=4, logging={"use_tensorboard": True, "log_every": 2},
                    sample={"sample_every": 2, "sample_steps": 2, "num_samples": 1})
    assert c.log_every == 2
    result = Trainer(c, verbose=False).train()
    acc = _events(tmp_path / "tb" / "tensorboard" / "tb")
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr/group0", "train/timestep", "train/grad_norm", "train/step_seconds"} <= tags
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in loss] == [2, 4]
    np.testing.assert_allclose([v for _, v in loss], result["losses"], rtol=1e-6)
    assert all(e.value > 0 for e in acc.Scalars("train/grad_norm"))
    assert [e.step for e in acc.Scalars("train/lr/group0")] == [2, 4]
    images = acc.Tags()["images"]
    assert "samples/0" in images and [e.step for e in acc.Images("samples/0")] == [0, 2, 4]


class _SameSecond:
    """tensorboardX's `time` module with time() fixed: both runs' event files get the same second in their name."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def time():
        return 1_700_000_000.0


def test_a_resumed_run_replaces_the_events_after_its_checkpoint(tmp_path, monkeypatch):
    import tensorboardX.event_file_writer as efw
    monkeypatch.setattr(efw, "time", _SameSecond())  # a resume within the same second must not overwrite

    def c(steps):
        return tiny_config(tmp_path, "tbr", steps=steps, logging={"use_tensorboard": True, "run_name": "exp1"},
                           save={"save_every": 2})
    Trainer(c(3), verbose=False).train()   # rows 1, 2, 3; checkpoints at 2 and 3
    shutil.rmtree(ckpt.checkpoint_dir(str(tmp_path / "tbr"), 3))  # as if killed before step 3's checkpoint
    again = Trainer(c(5), verbose=False)  # resumes at 2: steps 3 (again), 4, 5
    result = again.train()
    steps = [e.step for e in _events(tmp_path / "tbr" / "tensorboard" / "exp1").Scalars("train/loss")]
    assert again.resumed_from and steps == [1, 2, 3, 4, 5]  # step 3 once: the first run's was purged
    assert len(result["losses"]) == 5


def test_logging_section_is_checked(tmp_path):
    with pytest.raises(ConfigError) as ei:
        tiny_config(tmp_path, "bad", log_every=3, logging={"log_every": 2, "use_tensorboard": "yes",
                                                           "run_name": "a/b", "use_wandbb": True})
    msg = str(ei.value)
    for piece in ("logging.log_every: 2 differs from log_every 3; give one",
                  "logging.use_tensorboard: expected true or false, got 'yes'",
                  "logging.run_name: expected a name without slashes, got 'a/b'",
                  "logging.use_wandbb: unknown field; did you mean 'use_wandb'?"):
        assert piece in msg, msg


@pytest.mark.parametrize("field, package", [("use_tensorboard", "tensorboardX"), ("use_wandb", "wandb")])
def test_a_tracker_that_is_not_installed_stops_setup_naming_it(tmp_path, monkeypatch, field, package):
    monkeypatch.setitem(sys.modules, package, None)  # find_spec then raises ValueError; hide it properly:
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    tr = Trainer(tiny_config(tmp_path, "missing", logging={field: True}), verbose=False)
    with pytest.raises(ConfigError, match=f"logging.{field}: {package} is not installed"):
        tr.setup()
    assert not (tmp_path / "missing" / "config.json").exists()


def test_kohyas_max_norm_figures_are_logged(tmp_path):
    c = tiny_config(tmp_path, "mn", steps=4, logging={"use_tensorboard": True, "log_every": 2},
                    train={"scale_weight_norms": 0.02, "lr": 3e-2})
    Trainer(c, verbose=False).train()
    acc = _events(tmp_path / "mn" / "tensorboard" / "mn")
    assert [e.step for e in acc.Scalars("max_norm/keys_scaled")] == [2, 4]
    assert all(e.value == pytest.approx(0.02, rel=1e-3) for e in acc.Scalars("max_norm/max_key_norm"))
    assert all(0 < e.value <= 0.0201 for e in acc.Scalars("max_norm/average_key_norm"))
