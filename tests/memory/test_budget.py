"""One rule for a memory budget, in the trainer's config (max_gpu_memory) and on the command line
(--max-gpu-memory): a size with a unit, or a bare number meaning GiB; anything else, 0 or less refused."""
import pytest

from flame_core.memory.stats import parse_budget, parse_size
from flame_models import generate as G
from flame_models.training.config import ConfigError

GIB = 1 << 30
BAD = ["0", 0, -1, "-1", "lots", "12 parsecs", "", True, float("nan"), [12]]


def test_a_bare_number_is_gib_and_a_unit_is_read():
    assert parse_budget(12) == parse_budget("12") == parse_budget(" 12 ") == parse_budget("12GiB") == 12 * GIB
    assert parse_budget(1.5) == parse_budget("1.5") == 3 * GIB // 2
    assert parse_budget("512MiB") == 512 << 20 and parse_budget("24 GB") == 24 * 10 ** 9
    assert parse_budget(None) is None
    assert parse_size("12") == 12  # the byte-level API under it keeps bytes (torch.cuda's unit)


@pytest.mark.parametrize("value", BAD)
def test_bad_budgets_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^max_gpu_memory: a size such as '12GiB'"):
        parse_budget(value)


def test_the_command_line_reads_a_bare_number_as_gib_as_the_config_does():
    # before: --max-gpu-memory 12 was 12 bytes while max_gpu_memory: 12 in a config was 12 GiB
    assert G._budget("12") == G._budget(12) == 12 * GIB
    assert G._budget("6GiB") == 6 * GIB and G._budget(None) is None
    for value in BAD:
        with pytest.raises(G.GenerateError, match=r"^--max-gpu-memory: a size such as '12GiB'"):
            G._budget(value)


def test_the_config_reads_the_budget_with_the_same_rule(tmp_path):
    from flame_models.training.trainer import Trainer
    from tests.offload.test_trainer_streaming import cfg
    tr = Trainer(cfg(tmp_path, "half", "0.5"), verbose=False)
    tr.setup()
    assert tr.budget == GIB // 2
    for value in BAD[:-1]:  # (a list is refused by the config's type check with another message)
        with pytest.raises(ConfigError, match=r"max_gpu_memory: a size such as '12GiB'"):
            cfg(tmp_path, "bad", value)
