"""Full fine-tuning under max_gpu_memory (kohya's blocks_to_swap + fused backward pass): the blocks' weights stream
from pinned host memory and each block is updated inside backward (flame_nn.offload.LayerwiseOptimizer). The run
gives the resident full fine-tune's numbers, its checkpoints resume exactly, the written model holds the trained
weights, and what a layer-wise update cannot do is refused naming the field."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_models.training.config import ConfigError
from flame_models.training.family import get_family
from flame_models.training.finite import FiniteGuard, NonFiniteError
from flame_models.training.trainer import Trainer

from .test_full_finetune import full_config

BUDGET = "1GiB"   # (the tiny models fit it whole: tests choose the streamed blocks with set_resident)


def streamed_config(tmp_path, name, budget=BUDGET, arch="flux", steps=3, dtype="fp32", train=None, **top):
    t = {"optimizer": "adafactor", "max_grad_norm": 0, "gradient_checkpointing": True}
    t.update(train or {})
    top = dict(top)
    if budget is not None:
        top["max_gpu_memory"] = budget
    return full_config(tmp_path, name, arch=arch, steps=steps, dtype=dtype, train=t, **top)


def weights(tr):
    with tr._host_weights():
        return {n: p.detach().float().numpy().copy() for n, p in tr.model.named_parameters()}


@pytest.mark.parametrize("arch,resident,dtype,train", [
    ("flux", (), "fp32", {}),
    ("flux", (1, 2), "fp32", {"optimizer": "adamw"}),
    ("flux", (), "bf16", {"full_bf16": True, "optimizer": "adamw8bit"}),
    ("sd3", (0,), "fp32", {}),
    ("sdxl", (), "fp32", {"optimizer": "lion", "lr": 1e-4}),
    ("chroma", (1,), "fp32", {}),
    ("qwen_image", (), "fp32", {}),
    ("flux_kontext", (), "fp32", {}),
])
def test_a_streamed_full_fine_tune_gives_the_resident_runs_numbers(tmp_path, arch, resident, dtype, train):
    runs = {}
    for budget in (None, BUDGET):
        tr = Trainer(streamed_config(tmp_path, f"{arch}{budget}", budget, arch=arch, dtype=dtype, train=train),
                     verbose=False).setup()
        if budget is not None:
            assert isinstance(tr.optimizer, flame_nn.offload.LayerwiseOptimizer)
            tr.streamer.set_resident(resident)
            assert tr.streamer.streamed
        before = weights(tr)
        losses = [tr.train_step()[0] for _ in range(3)]
        runs[budget] = (losses, weights(tr), before, tr)
    (la, wa, before, _), (lb, wb, _, tr) = runs[None], runs[BUDGET]
    assert tr.optimizer.block_steps == 3 * len(tr.streamer.blocks)
    assert np.isfinite(la).all()
    np.testing.assert_array_equal(lb, la)
    assert sorted(wa) == sorted(wb)
    moved = [n for n in wa if not np.array_equal(wa[n], before[n])]
    assert len(moved) > 0.8 * len(wa), (len(moved), len(wa))
    stacks = tuple(s + "." for s in get_family(arch).block_stacks(tr.model))
    assert any(n.startswith(stacks) for n in moved) and any(not n.startswith(stacks) for n in moved)
    for n in wa:
        np.testing.assert_array_equal(wb[n], wa[n], err_msg=n)
    # the blocks' weights are held in float32 (unless full_bf16) in host memory, and none is on the device whole
    for n, p in tr.model.named_parameters():
        if n.startswith(stacks):
            assert p.dtype == (flame.bfloat16 if train.get("full_bf16") else flame.float32), n


def test_checkpoints_resume_exactly_and_the_written_model_is_the_trained_one(tmp_path):
    def cfg():
        return streamed_config(tmp_path, "resume", steps=4, save={"save_every": 2, "dtype": "fp32"})
    whole = Trainer(cfg(), verbose=False).setup()
    whole.streamer.set_resident([2])
    for _ in range(2):
        whole.train_step()
    whole.save_checkpoint()
    want_loss = [whole.train_step()[0] for _ in range(2)]
    want = weights(whole)
    again = Trainer(cfg(), verbose=False).setup()
    assert again.resumed_from and again.step == 2
    again.streamer.set_resident([0, 3])   # another placement: the weights come from the host copies
    got_loss = [again.train_step()[0] for _ in range(2)]
    np.testing.assert_array_equal(got_loss, want_loss)
    got = weights(again)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    path = again.save_lora(str(tmp_path / "model.safetensors"))
    fam = get_family("flux")
    back = dict(fam.load_model(path, fam.read_spec(path), flame.float32, "cpu").named_parameters())
    assert sorted(back) == sorted(want)
    for n in want:
        np.testing.assert_array_equal(back[n].detach().numpy(), want[n], err_msg=n)
    # after the save the run trains on from the same weights (the slots loaded again from the host copies)
    assert np.isfinite(again.train_step()[0])


def test_a_whole_run_saves_previews_and_the_model(tmp_path):
    cfg = streamed_config(tmp_path, "run", steps=2, sample={"sample_every": 2, "sample_steps": 2})
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    assert result["steps"] == 2 and np.isfinite(result["losses"]).all()
    fam = get_family("flux")
    back = dict(fam.load_model(result["lora"], fam.read_spec(result["lora"]), flame.float32, "cpu").named_parameters())
    want = weights(tr)
    for n in want:   # written at save.dtype (bf16) from the trained float32 weights
        np.testing.assert_array_equal(back[n].detach().numpy(),
                                      want[n].astype(flame.bfloat16.np).astype(np.float32), err_msg=n)


@pytest.mark.parametrize("train, field", [
    ({"optimizer": "prodigy", "lr": 1.0}, "train.optimizer"),
    ({"optimizer": "adamw_schedulefree"}, "train.optimizer"),
    ({"gradient_accumulation_steps": 2}, "train.gradient_accumulation_steps"),
    ({"ema_config": {"use_ema": True}}, "train.ema_config.use_ema"),
])
def test_what_a_layerwise_update_cannot_do_is_refused(tmp_path, train, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        streamed_config(tmp_path, "refused", train=train)
    streamed_config(tmp_path, "fine", budget=None, train=train)   # without max_gpu_memory each is fine


def test_the_state_left_on_the_device_is_checked_against_the_budget(tmp_path):
    # adamw keeps 8 bytes per parameter on the device: more than a budget that holds the streamed weights' slots
    from flame_models.training import full_finetune
    fam = get_family("flux")
    model = fam.model_class(fam.preset("flux-tiny"), dtype=flame.bfloat16)
    from flame_models.training.config import NetworkConfig
    selected = full_finetune.select(model, NetworkConfig(type="full"))
    streamed = frozenset(id(p) for s in fam.block_stacks(model) for p in model.get_submodule(s).parameters())
    state = sum(full_finetune.state_bytes("adamw", p) for _, p in selected)
    rest = sum(p.numel() for _, p in selected if id(p) not in streamed)
    need = state + rest * (2 + 4)   # the rest's float32 part and its gradients; the blocks' values are on the host
    assert full_finetune.problems(selected, "cpu", need, "adamw", streamed=streamed) == []
    msg = full_finetune.problems(selected, "cpu", need - 1, "adamw", streamed=streamed)[0]
    assert "optimizer state" in msg and "adafactor: a few MiB" in msg
    adafactor = sum(full_finetune.state_bytes("adafactor", p) for _, p in selected)
    assert adafactor < state / 10   # factored: a row and a column per matrix
    assert full_finetune.problems(selected, "cpu", need - state + adafactor, "adafactor", streamed=streamed) == []


def test_the_guard_stops_on_a_blocks_non_finite_gradients():
    seen = [flame.tensor(True, device="cpu"), flame.tensor(False, device="cpu")]
    guard = FiniteGuard([], "cpu", also=lambda: seen.pop(0))
    guard.after_backward(1)
    guard.check()
    guard.after_backward(2)
    with pytest.raises(NonFiniteError, match="step 2: the gradients became NaN"):
        guard.check()
