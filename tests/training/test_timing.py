"""ai-toolkit's performance_log_every: a timing report of each window of N steps (where the wall-clock time went:
the step, the loader's batches, previews, validation, saves, the rest), off at 0, a bad value named."""
import re
import time

import pytest

from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.timing import TimingReport
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


def test_each_window_reports_its_phases_per_step():
    lines = []
    timing = TimingReport(2, lines.append)
    for step in (1, 2, 3):
        with timing.phase("step"):
            with timing.phase("data"):
                time.sleep(0.002)
            time.sleep(0.004)
        if step == 2:
            with timing.phase("saves"):
                time.sleep(0.01)
        timing.step_done(step)
    assert len(lines) == 1 and lines[0].startswith("timing, steps 1-2 (2 steps in ")
    got = dict(re.findall(r"(step|data|saves|other) ([\d.]+)", lines[0]))
    assert float(got["data"]) >= 2.0 and float(got["step"]) >= 4.0      # the step less its data
    assert float(got["saves"]) >= 5.0                                    # 10 ms over 2 steps
    assert "previews" not in lines[0] and timing.steps == 1 and timing.first == 3   # the next window began
    with pytest.raises(ValueError, match="unknown phase 'loading'"):
        timing.phase("loading")
    off = TimingReport(0, lines.append)
    with off.phase("step"):
        pass
    assert off.step_done(2) is None and len(lines) == 1


def test_a_run_logs_a_report_every_n_steps(tmp_path, capsys):
    Trainer(tiny_config(tmp_path, "timed", steps=4, performance_log_every=2)).train()
    out = capsys.readouterr()
    reports = re.findall(r"timing, steps [^\r\n]*", out.out + out.err)   # (between progress-bar redraws)
    assert [r.split(" (")[0] for r in reports] == ["timing, steps 1-2", "timing, steps 3-4"]
    assert all("step " in r and "data " in r and "steps/s" in r for r in reports)
    assert "saves " in reports[0] or "saves " in reports[1]   # save_every 3: a checkpoint in the second window


@pytest.mark.parametrize("value", [-1, 1.5, True, "often"])
def test_a_bad_value_is_named(tmp_path, value):
    with pytest.raises(ConfigError, match="performance_log_every: "):
        config_from_dict({"performance_log_every": value, "synthetic": {}, "training_folder": str(tmp_path)})
