"""The trainer's max_gpu_memory: the same losses as without streaming, blocks split between resident and streamed
by the budget, a budget below the minimum refused before training starts, and the config checks the value."""
import numpy as np
import pytest

import flame_core.memory as M
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.trainer import Trainer
from flame_nn.offload import MemoryBudgetError


def cfg(tmp_path, name, max_gpu_memory=None, **train):
    d = {"name": name, "training_folder": str(tmp_path), "device": "cpu",
         "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
         "synthetic": {"num_samples": 4, "height": 64, "width": 64, "text_length": 8},
         "train": {"steps": 3, "batch_size": 1, "optimizer": "adamw", "lr": 1e-3, "dtype": "fp32",
                   "gradient_checkpointing": True},
         "model": {"size": "flux-tiny", "dtype": "fp32"},
         "sample": {"sample_every": 0}, "save": {"save_every": 1000}}
    d["train"].update(train)
    if max_gpu_memory is not None:
        d["max_gpu_memory"] = max_gpu_memory
    return config_from_dict(d)


def test_max_gpu_memory_streams_blocks_and_trains_the_same(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the trainer's device comes from the config; this test pins cpu")
    plain = Trainer(cfg(tmp_path, "plain"), verbose=False).setup()
    want = [plain.train_step()[0] for _ in range(3)]

    probe = Trainer(cfg(tmp_path, "probe", "4GiB"), verbose=False).setup()
    assert probe.fit.streamed == []  # everything fits: every block resident
    minimum = probe.fit.minimum
    double, single = probe.streamer.block_bytes(0), probe.streamer.block_bytes(2)  # flux-tiny: 2 double, 2 single
    del probe

    budget = int((minimum + double + 0.5 * single) / 0.98)  # the default headroom is 2% of the budget
    tr = Trainer(cfg(tmp_path, "streamed", f"{budget}B"), verbose=False).setup()
    fit = tr.fit
    assert 1 <= len(fit.resident) <= 3 and len(fit.streamed) >= 1, fit
    M.reset_peak_memory_stats(device)
    got = [tr.train_step()[0] for _ in range(3)]
    assert M.max_memory_reserved(device) <= budget
    np.testing.assert_allclose(got, want, rtol=1e-6)  # the measurement steps left data and randomness untouched

    assert M.get_memory_limit(device) == budget  # the run is held to its budget
    del tr
    M.set_memory_limit(None, device)
    with pytest.raises(MemoryBudgetError, match="below the minimum"):
        Trainer(cfg(tmp_path, "tiny", f"{minimum // 2}B"), verbose=False).setup()


def test_max_gpu_memory_is_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"max_gpu_memory: a size such as '12GiB'"):
        cfg(tmp_path, "bad", "lots")
    assert cfg(tmp_path, "ok", 12).max_gpu_memory == 12


def test_offload_activations_under_max_gpu_memory_trains_the_same(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the trainer's device comes from the config; this test pins cpu")
    plain = Trainer(cfg(tmp_path, "plain", "4GiB"), verbose=False).setup()
    assert not plain.fit.offload_activations  # 4 GiB holds flux-tiny: nothing offloaded
    want = [plain.train_step()[0] for _ in range(3)]
    del plain
    tr = Trainer(cfg(tmp_path, "offloaded", "4GiB", offload_activations=True), verbose=False).setup()
    assert tr.fit.offload_activations and tr.streamer.offload_activations
    got = [tr.train_step()[0] for _ in range(3)]
    assert tr.streamer.activations.stats["bytes_d2h"] > 0
    np.testing.assert_allclose(got, want, rtol=1e-6)
    M.set_memory_limit(None, device)


def test_offload_activations_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="offload_activations: expected true or false"):
        cfg(tmp_path, "bad", "4GiB", offload_activations="yes")
    with pytest.raises(ConfigError, match="offload_activations: the block inputs are offloaded by the streamed"):
        cfg(tmp_path, "nobudget", offload_activations=True)
