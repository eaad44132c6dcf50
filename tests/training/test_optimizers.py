"""Issue 47 through the trainer: Prodigy, Adafactor, Lion and schedule-free AdamW by the peers' names, their
optimizer_params checked, the cosine_with_restarts and polynomial schedules, and exact resumes through a checkpoint
(Prodigy's D estimate and schedule-free's running sums come from the checkpoint, not from the fresh optimizer)."""
import types

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import io
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


@pytest.mark.parametrize("given, name, cls", [
    ("Prodigy", "prodigy", "Prodigy"), ("AdaFactor", "adafactor", "Adafactor"), ("lion", "lion", "Lion"),
    ("AdamWScheduleFree", "adamw_schedulefree", "AdamWScheduleFree"),
    ("adamw_schedulefree", "adamw_schedulefree", "AdamWScheduleFree"), ("AdamW8bit", "adamw8bit", "AdamW8bit"),
    ("adamw", "adamw", "AdamW"), ("RAdam", "radam", "RAdam"), ("NAdam", "nadam", "NAdam")])
def test_peer_names_pick_the_optimizer(tmp_path, given, name, cls):
    c = tiny_config(tmp_path, "names", train={"optimizer": given, "lr": 1.0 if name == "prodigy" else 1e-3})
    assert c.train.optimizer == name
    tr = Trainer(c, verbose=False).setup()
    assert type(tr.optimizer) is getattr(flame_nn.optim, cls)


def test_optimizer_params_are_each_optimizers_own_arguments(tmp_path):
    ok = tiny_config(tmp_path, "p", train={"optimizer": "prodigy", "lr": 1.0, "optimizer_params": {
        "d_coef": "2", "use_bias_correction": True, "safeguard_warmup": True, "betas": [0.9, 0.99],
        "weight_decay": 0.01, "slice_p": 1, "beta3": None}})
    assert ok.train.optimizer_params["d_coef"] == 2.0
    tr = Trainer(ok, verbose=False).setup()
    g = tr.optimizer.param_groups[0]
    assert (g["d_coef"], g["use_bias_correction"], g["betas"], g["beta3"]) == (2.0, True, (0.9, 0.99), None)
    af = Trainer(tiny_config(tmp_path, "a", train={"optimizer": "adafactor", "optimizer_params": {"beta1": 0.9}}),
                 verbose=False).setup()
    g = af.optimizer.param_groups[0]  # ai-toolkit's defaults: the config's lr, no relative step or scaling
    assert (g["initial_lr"], g["relative_step"], g["scale_parameter"], g["beta1"]) == (3e-3, False, False, 0.9)
    with pytest.raises(ConfigError) as ei:
        tiny_config(tmp_path, "bad", train={"optimizer": "lion", "text_encoder_lr": None, "optimizer_params": {
            "eps": 1e-8, "decoupled_weight_decay": "yes", "betas": [0.9, 1.5]}})
    msg = str(ei.value)
    for piece in ("train.optimizer_params.eps: unknown; supported: betas, weight_decay, decoupled_weight_decay",
                  "train.optimizer_params.decoupled_weight_decay: expected true or false, got 'yes'",
                  "train.optimizer_params.betas: each beta must be in [0, 1)"):
        assert piece in msg, msg
    with pytest.raises(ConfigError, match="relative_step: true is not supported"):
        tiny_config(tmp_path, "bad", train={"optimizer": "adafactor", "optimizer_params": {"relative_step": True}})
    with pytest.raises(ConfigError, match="prodigy takes one lr"):
        tiny_config(tmp_path, "bad", train={"optimizer": "prodigy", "lr": 1.0, "text_encoder_lr": 0.5})
    with pytest.raises(ConfigError, match="train.optimizer"):
        tiny_config(tmp_path, "bad", train={"optimizer": "sophia"})


def test_schedules_by_name_with_their_params(tmp_path):
    with pytest.raises(ConfigError) as ei:
        tiny_config(tmp_path, "s", train={"lr_scheduler": "polynomial",
                                          "lr_scheduler_params": {"num_cycles": 2, "power": -1}})
    assert "lr_scheduler_params.num_cycles: unknown for lr_scheduler polynomial; supported: power, lr_end" in \
        str(ei.value)
    assert "lr_scheduler_params.power: must be > 0" in str(ei.value)
    c = tiny_config(tmp_path, "s", steps=10, train={"lr_scheduler": "cosine_with_restarts", "lr_warmup_steps": 0,
                                                   "lr_scheduler_params": {"num_cycles": 2}})
    tr = Trainer(c, verbose=False).setup()
    lrs = [tr.train_step()[1] for _ in range(6)]
    np.testing.assert_allclose(lrs, [3e-3 * 0.5 * (1 + np.cos(np.pi * ((2 * s / 10) % 1))) for s in range(6)])
    c = tiny_config(tmp_path, "p", steps=10, train={"lr_scheduler": "polynomial", "lr_warmup_steps": 0,
                                                   "lr_scheduler_params": {"power": 2.0, "lr_end": 1e-4}})
    tr = Trainer(c, verbose=False).setup()
    lrs = [tr.train_step()[1] for _ in range(3)]
    np.testing.assert_allclose(lrs, [(3e-3 - 1e-4) * (1 - s / 10) ** 2 + 1e-4 for s in range(3)])


@pytest.mark.parametrize("opt, lr, params", [
    ("prodigy", 1.0, {"weight_decay": 0.01, "d_coef": 10.0}),
    ("adafactor", 3e-3, {"beta1": 0.9}),
    ("lion", 3e-4, {"weight_decay": 0.1}),
    ("adamw_schedulefree", 3e-3, {"warmup_steps": 2}),
    ("radam", 3e-3, {"betas": [0.9, 0.9], "decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("nadam", 3e-3, {"momentum_decay": 0.01}),
])
def test_each_optimizer_trains_and_resumes_exactly_through_a_checkpoint(tmp_path, opt, lr, params):
    def c():
        return tiny_config(tmp_path, opt, steps=6, train={"optimizer": opt, "lr": lr, "optimizer_params": params,
                                                          "lr_scheduler": "cosine_with_restarts",
                                                          "lr_warmup_steps": 0})
    full = Trainer(c(), verbose=False).setup()
    before = [p.detach().numpy().copy() for p in full.params]
    for _ in range(3):
        full.train_step()
    assert any(not np.array_equal(a, p.detach().numpy()) for a, p in zip(before, full.params))
    at3 = [p.detach().numpy().copy() for p in full.params]
    groups3 = [dict(g, params=None) for g in full.optimizer.param_groups]
    full.save_checkpoint()
    # saving leaves the training point untouched (schedule-free saves its average x, then comes back exactly)
    for a, p in zip(at3, full.params):
        np.testing.assert_array_equal(a, p.detach().numpy())
    if opt == "adamw_schedulefree":  # the step's LoRA holds x = lerp(y, z, 1 - 1/beta1), not the training point y
        lora = io.load_file(str(tmp_path / opt / f"{opt}_000003.safetensors"))
        checked = 0
        for name, p in full.named_adapter_parameters():
            if name.endswith(".lora_A"):
                y, z = p.detach().numpy(), full.optimizer.state[p]["z"].numpy()
                x = y + (1 - 1 / 0.9) * (z - y)
                saved = lora["lora_unet_" + name[:-len(".lora_A")].replace(".", "_") + ".lora_down.weight"].numpy()
                np.testing.assert_allclose(saved, x, rtol=1e-6, atol=1e-9)
                checked += not np.allclose(saved, y, rtol=1e-6, atol=1e-9)
        assert checked > 0
    want = [full.train_step()[0] for _ in range(3)]
    want_p = [p.detach().numpy().copy() for p in full.params]
    again = Trainer(c(), verbose=False).setup()
    assert again.step == 3
    running = getattr(again.optimizer, "running_keys", ())
    for mine, theirs in zip(again.optimizer.param_groups, groups3):
        assert {k: mine[k] for k in running if k in theirs} == {k: theirs[k] for k in running if k in theirs}
    if opt == "prodigy":
        assert groups3[0]["d"] > 1e-6  # the estimate grew: a resume that restarted it at d0 would differ
    got = [again.train_step()[0] for _ in range(3)]
    np.testing.assert_array_equal(got, want)
    for a, b in zip(again.params, want_p):
        np.testing.assert_array_equal(a.detach().numpy(), b)


def test_config_from_dict_keeps_default_optimizer(tmp_path):
    c = config_from_dict({"synthetic": {"num_samples": 2}, "training_folder": str(tmp_path)})
    assert c.train.optimizer == "adamw8bit" and c.train.optimizer_params == {}


def test_loraplus_trains_the_up_matrices_at_lr_times_the_ratio(tmp_path):
    """network.loraplus_lr_ratio (kohya's LoRA+): the denoiser's adapters in two groups -- every lora_A at lr, every
    lora_B at lr x ratio --, the schedule over both; AdamW's first step moves each tensor by about its group's lr
    (B starts at 0, so its first update is lr x ratio in size); the ratio's refusals."""
    from flame_nn import adapters as A
    c = tiny_config(tmp_path, "lp", network={"loraplus_lr_ratio": 16},
                    train={"optimizer": "adamw", "lr": 1e-4, "steps": 1, "lr_warmup_steps": 0})
    tr = Trainer(c, verbose=False).setup()
    g0, g1 = tr.optimizer.param_groups
    assert (g0["lr"], g1["lr"]) == (1e-4, 1.6e-3)
    named = A.named_adapter_parameters(tr.model)
    ups = [p for n, p in named if n.endswith(".lora_B")]
    assert g1["params"] == ups and len(g0["params"]) + len(ups) == len(tr.params) and ups
    assert all(not n.endswith(".lora_B") for n, p in named if any(p is q for q in g0["params"]))
    before = {n: p.detach().numpy().copy() for n, p in named}
    tr.train()
    moved = {n: np.abs(p.detach().numpy() - before[n]).max() for n, p in named}
    up_moves = [m for n, m in moved.items() if n.endswith(".lora_B")]
    down_moves = [m for n, m in moved.items() if n.endswith(".lora_A") and m > 0]
    assert up_moves and max(up_moves) == pytest.approx(1.6e-3, rel=0.05)
    assert down_moves == [] or max(down_moves) < 2e-4        # (A gets no gradient while B is 0: at most decay)
    # with trained text encoders (their own group at text_encoder_lr): each group splits, with its own ratio
    te_a, te_b = flame_nn.Parameter(flame.zeros(2)), flame_nn.Parameter(flame.zeros(2))
    tr.text_encoders = types.SimpleNamespace(params=[te_a, te_b],
                                             named_parameters=lambda: [("te1/q.lora_A", te_a), ("te1/q.lora_B", te_b)])
    tr.params = tr.params + [te_a, te_b]
    tr.cfg.network.loraplus_text_encoder_lr_ratio = 2.0
    tr.cfg.train.text_encoder_lr = 1e-3
    groups = tr._param_groups()
    assert [lr for _, lr in groups] == [1e-4, 1.6e-3, 1e-3, 2e-3]
    assert groups[2][0] == [te_a] and groups[3][0] == [te_b] and groups[1][0] == ups
    plain = Trainer(tiny_config(tmp_path, "np", train={"optimizer": "adamw"}), verbose=False).setup()
    assert len(plain.optimizer.param_groups) == 1
    for change, msg in (({"network": {"loraplus_lr_ratio": 0}}, "network.loraplus_lr_ratio: a ratio > 0"),
                        ({"network": {"type": "lokr", "loraplus_lr_ratio": 4}}, "network type 'lokr'|"
                                                                               "network.type 'lokr' has none"),
                        ({"network": {"loraplus_text_encoder_lr_ratio": 4}}, "only used with "
                                                                            "train.train_text_encoder"),
                        ({"network": {"loraplus_lr_ratio": 4}, "train": {"optimizer": "prodigy", "lr": 1.0}},
                         "prodigy takes one lr for every parameter group")):
        with pytest.raises(ConfigError, match=msg):
            tiny_config(tmp_path, "bad", **change)


@pytest.mark.parametrize("given, lr, te, want, said", [
    ("prodigyopt", 1e-4, None, 1.0, True),      # ai-toolkit's UI: its package name and its default lr
    ("prodigy", 0.5, None, 0.5, False),         # at or above 0.1 the lr is the config's
])
def test_prodigys_lr_as_ai_toolkit_sets_it(tmp_path, given, lr, te, want, said):
    """ai-toolkit's Prodigy: an lr below 0.1 (its UI's default 1e-4) raised to 1.0, said in a warning; its UI's name
    prodigyopt read as prodigy."""
    train = {"optimizer": given, "lr": lr, **({"text_encoder_lr": te} if te is not None else {})}
    c = tiny_config(tmp_path, "prodigy_lr", train=train)
    assert c.train.optimizer == "prodigy" and c.train.lr == want
    assert c.train.text_encoder_lr == (want if te is not None else None)
    assert any("with prodigy is raised to 1.0, as ai-toolkit does below 0.1" in w for w in c.warnings) == said


def test_prodigys_raised_lr_carries_the_text_encoders_lr_with_it(tmp_path):
    from flame_models.training.config import config_from_dict
    c = config_from_dict({"name": "x", "training_folder": str(tmp_path), "datasets": [{"folder_path": str(tmp_path)}],
                          "model": {"arch": "sdxl"}, "train": {"optimizer": "prodigy", "lr": 1e-4,
                                                               "text_encoder_lr": 1e-4, "train_text_encoder": True}},
                         check_files=False)
    assert (c.train.lr, c.train.text_encoder_lr) == (1.0, 1.0)
