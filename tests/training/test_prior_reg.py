"""Datasets with prior_reg (ai-toolkit's; SimpleTuner's is_regularisation_data): their samples train toward the
model's prediction without its adapters (same noisy latents, timestep and caption) instead of toward the data; a
batch without them runs the plain step; training keeps their predictions nearer the base model's; the config's
mistakes are named (tiny Flux, cpu)."""
import shutil

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_core.autograd import no_grad
from flame_models.training import preservation, prior_reg
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prior")
    train = draw_images(root / "train", n_concept=2, n_other=0)
    keep = draw_images(root / "keep", n_concept=0, n_other=2)
    return train, keep


def _config(tmp_path, name, folders, steps=4, prior=True, model=None, first=False, **top):
    """image_config's run over the two folders, the second (and with `first` the first too) prior_reg."""
    train, keep = folders
    ds = [{"folder_path": train, "resolution": 64, "bucket_tolerance": 32, **({"prior_reg": True} if first else {})},
          {"folder_path": keep, "resolution": 64, "bucket_tolerance": 32, "prior_reg": prior}]
    return image_config(tmp_path, name, model, train, steps=steps, datasets=ds, **top)


def _random_adapters(model, seed=0):
    g = np.random.default_rng(seed)
    with no_grad():
        for p in A.adapter_parameters(model):
            p.copy_(flame.tensor(g.standard_normal(tuple(p.shape)).astype(np.float32) * 0.05, device="cpu"))


def _batch_with(tr, want):
    """The loader's next batch whose prior_reg flags hold `want` (any True / all False)."""
    for _ in range(40):
        b = tr.loader.next_batch()
        if bool(np.any(b["prior_reg"])) == want:
            return b
    raise AssertionError("no such batch in 40 draws")


def test_the_prior_samples_target_is_the_adapter_free_prediction(tmp_path, folders, tiny_model):
    """On one micro-batch holding prior_reg samples: the step's loss is the objective's loss against the flow target
    for the others and against the adapter-free prediction for them (by hand); the adapters are on again after;
    a batch without them carries None (its own graph key) and runs the plain step."""
    tr = Trainer(_config(tmp_path, "step", folders, model=tiny_model, train={"batch_size": 4}), verbose=False)
    tr.setup()
    _random_adapters(tr.model)
    batch = _batch_with(tr, True)
    args, _ = tr._prepare(batch)
    cond = dict(zip(tr._cond_keys, args[3:]))
    mask = cond.pop(prior_reg.KEY)
    assert mask is not None and np.array_equal(mask.numpy(), batch["prior_reg"].astype(np.float32))
    loss = float(tr._forward_backward(*args))
    assert A.adapter_names(tr.model) == ["default"] and all(m.adapters_enabled for _, m in A.adapted_modules(tr.model))
    x0, noise, t = args[:3]
    x_t = tr.objective.noisy(x0, noise, t)
    with no_grad():
        with preservation.adapters_off(tr.model):
            base = tr.family.forward(tr.model, x_t, t, cond)
        pred = tr.family.forward(tr.model, x_t, t, cond)
    target = tr.objective.target(x0, noise, t).numpy()
    m = batch["prior_reg"]
    target[m] = base.numpy()[m]
    want = float(np.mean((pred.numpy().astype(np.float64) - target) ** 2))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    plain = float(np.mean((pred.numpy().astype(np.float64) - tr.objective.target(x0, noise, t).numpy()) ** 2))
    assert abs(plain - want) > 1e-6 * abs(want)                          # the prior target changed the loss
    # a batch without prior samples: None under the key, the objective's own target
    other, _ = tr._prepare({**batch, "prior_reg": np.zeros_like(batch["prior_reg"])})
    assert dict(zip(tr._cond_keys, other[3:]))[prior_reg.KEY] is None
    assert np.isfinite(float(tr._forward_backward(*other)))


def test_training_keeps_the_prior_images_nearer_the_base_model(tmp_path, folders, tiny_model):
    """Trained alike with and without prior_reg on the second folder (16 steps), its images' predictions drift
    from the adapter-free model's less with it."""
    models = {}
    for on in (False, True):
        tr = Trainer(_config(tmp_path, f"drift{on}", folders, steps=16, prior=on, model=tiny_model,
                             train={"lr": 1e-2, "batch_size": 2}), verbose=False)
        assert np.isfinite(tr.train()["losses"]).all()
        models[on] = tr
    probe = models[True]
    flame.manual_seed(3)
    batch = _batch_with(probe, True)
    keep = np.asarray(batch["prior_reg"])
    args, _ = probe._prepare(batch)
    cond = dict(zip(probe._cond_keys, args[3:]))
    cond.pop(prior_reg.KEY)
    x_t = probe.objective.noisy(*args[:3])
    drift = {}
    with no_grad():
        for on, tr in models.items():
            with preservation.adapters_off(tr.model):
                base = tr.family.forward(tr.model, x_t, args[2], cond).numpy()[keep]
            pred = tr.family.forward(tr.model, x_t, args[2], cond).numpy()[keep]
            drift[on] = float(np.mean((pred - base) ** 2))
    assert 0 < drift[True] < 0.5 * drift[False], drift


def test_the_graph_plan_counts_both_kinds_of_batch_and_streams_eagerly(tmp_path, folders, tiny_model):
    from flame_models.training.graphs import graph_plan
    assert graph_plan(4, None, True, True)[0] is False and graph_plan(2, None, True, True)[0] is True
    assert "prior_reg" in graph_plan(1, 1 << 33, True, True, streamed_prior=True)[1]


@pytest.mark.parametrize("change, words", [
    ({"network": {"type": "full"}, "drop": ["network.linear", "network.linear_alpha", "network.target",
                                            "save.format"]},
     r"datasets\[1\].prior_reg: the prior prediction is the model without its adapters"),
    ({"first": True}, r"datasets\[0\].prior_reg: every dataset is prior_reg"),
    ({"prior": "yes"}, r"datasets\[1\].prior_reg: expected true or false"),
])
def test_config_mistakes_are_named(tmp_path, folders, tiny_model, change, words):
    with pytest.raises(ConfigError, match=words):
        _config(tmp_path, "bad", folders, model=tiny_model, **change)


def test_sdxl_refuses_it_with_trained_text_encoders(tmp_path):
    from sdxl_tiny import sdxl_tiny_folder

    from . import test_sd_families as fam
    model = sdxl_tiny_folder(tmp_path / "sdxl")
    images = draw_images(tmp_path / "images", n_concept=1, n_other=1)
    keep = str(tmp_path / "keep")
    shutil.copytree(images, keep)
    ds = [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32},
          {"folder_path": keep, "resolution": 64, "bucket_tolerance": 32, "prior_reg": True}]
    with pytest.raises(ConfigError, match=r"datasets\[1\].prior_reg: not with train.train_text_encoder"):
        fam.sdxl_config(tmp_path, "te", model, images, train={"train_text_encoder": True}, datasets=ds)
