"""The trainer's train.fp8_cache_transposes: auto caches the fp8-compute blocks' W^T without max_gpu_memory and not
under it, false never, true under a budget the resident blocks' only; the losses are those of the uncached run bit
for bit, and a cached run writes no transpose per backward call. (The option's parsing: tests/training/
test_config.py.)"""
import numpy as np
import pytest

import flame_core.memory as M
from flame_models.training.config import config_from_dict
from flame_models.training.trainer import Trainer
from flame_nn.offload import fp8 as F8
from flame_nn.offload import is_fp8_linear
from flame_nn.offload.fp8_transposes import cached_transposes


def cfg(tmp_path, name, max_gpu_memory=None, **train):
    d = {"name": name, "training_folder": str(tmp_path), "device": "cpu",
         "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
         "synthetic": {"num_samples": 4, "height": 64, "width": 64, "text_length": 8},
         "train": {"steps": 3, "batch_size": 1, "optimizer": "adamw", "lr": 1e-3, "dtype": "fp32",
                   "gradient_checkpointing": True, "fp8_compute": True},
         "model": {"size": "flux-tiny", "dtype": "fp32", "quantize": "fp8"},
         "sample": {"sample_every": 0}, "save": {"save_every": 1000}}
    d["train"].update(train)
    if max_gpu_memory is not None:
        d["max_gpu_memory"] = max_gpu_memory
    return config_from_dict(d)


@pytest.fixture
def scratch_calls(monkeypatch):
    calls = [0]
    real = F8.transposed_into_scratch

    def counted(q):
        calls[0] += 1
        return real(q)
    monkeypatch.setattr(F8, "transposed_into_scratch", counted)
    return calls


def _block_fp8(tr):
    """{name: module} of the fp8-compute Linears of the trainer's block stacks."""
    stacks = tr.family.block_stacks(tr.model)
    return {n: m for n, m in tr.model.named_modules() if is_fp8_linear(m) and n.split(".")[0] in stacks}


@pytest.fixture
def cpu_only(device):
    if device.type != "cpu":
        pytest.skip("the trainer's device comes from the config; this test pins cpu")


def test_auto_caches_without_a_budget_and_trains_the_same_bits_without_transposing(tmp_path, scratch_calls,
                                                                                   cpu_only):
    off = Trainer(cfg(tmp_path, "off", fp8_cache_transposes=False), verbose=False).setup()
    assert _block_fp8(off) and cached_transposes(off.model) == {}
    want = [off.train_step()[0] for _ in range(3)]
    assert scratch_calls[0] > 0                                       # the uncached run transposes per call
    del off

    logged = []
    auto = Trainer(cfg(tmp_path, "auto", fp8_cache_transposes="auto"), verbose=False)
    auto.verbose, auto.log = True, logged.append
    auto.setup()
    fp8 = _block_fp8(auto)
    assert sorted(cached_transposes(auto.model)) == sorted(fp8)       # every block's fp8 Linear
    held = sum(m.weight.numel() for m in fp8.values())
    assert [line for line in logged if line.startswith("train.fp8_cache_transposes:")] == [
        f"train.fp8_cache_transposes: the transposed weights of {len(fp8)} fp8 Linears kept resident, "
        f"{M.stats.fmt_bytes(held)}"]
    n = scratch_calls[0]
    got = [auto.train_step()[0] for _ in range(3)]
    assert scratch_calls[0] == n                                      # no transpose in a cached step
    np.testing.assert_array_equal(got, want)


def test_under_a_budget_auto_caches_nothing_and_true_the_resident_blocks_only(tmp_path, scratch_calls, cpu_only):
    auto = Trainer(cfg(tmp_path, "auto", "4GiB"), verbose=False).setup()
    assert auto.fit.streamed == [] and cached_transposes(auto.model) == {}      # auto under a budget: off
    want = [auto.train_step()[0] for _ in range(3)]
    del auto
    M.set_memory_limit(None, "cpu")
    probe = Trainer(cfg(tmp_path, "probe", "4GiB", fp8_cache_transposes=True), verbose=False).setup()
    assert probe.fit.streamed == [] and sorted(cached_transposes(probe.model)) == sorted(_block_fp8(probe))
    minimum = probe.fit.minimum             # (the fit keeps room for every block's transposes: true's upper bound)
    double, single = probe.streamer.block_bytes(0), probe.streamer.block_bytes(2)  # flux-tiny: 2 double, 2 single
    del probe
    M.set_memory_limit(None, "cpu")

    budget = int((minimum + double + 0.5 * single) / 0.98)  # the default headroom is 2% of the budget
    tr = Trainer(cfg(tmp_path, "true", f"{budget}B", fp8_cache_transposes=True), verbose=False).setup()
    resident, streamed = tr.fit.resident, tr.fit.streamed
    assert resident and streamed, tr.fit
    names = tr.streamer.names                                          # "double_blocks.0", ..., by block index
    fp8 = _block_fp8(tr)
    in_resident = {n for n in fp8 if any(n.startswith(names[i] + ".") for i in resident)}
    assert in_resident and len(in_resident) < len(fp8)
    assert sorted(cached_transposes(tr.model)) == sorted(in_resident)  # the streamed blocks' never
    n = scratch_calls[0]
    M.reset_peak_memory_stats("cpu")
    got = [tr.train_step()[0] for _ in range(3)]
    assert scratch_calls[0] > n                                       # the streamed blocks still transpose
    assert M.max_memory_reserved("cpu") <= budget
    np.testing.assert_allclose(got, want, rtol=1e-6)  # as the uncached all-resident run (streaming's own tolerance)
    M.set_memory_limit(None, "cpu")
