"""ai-toolkit's output preservation (train.diff_output_preservation, blank_prompt_preservation): each sample carries
its caption with the trigger word replaced by the class word (or the empty prompt), encoded with the captions; a
step's loss is the run's loss plus multiplier x the MSE between that prompt's prediction and the adapter-free model's;
training with it keeps the class prompt's prediction nearer the base model's; every mistake is named before anything
loads (tiny Flux, cpu)."""
import copy

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
import flame_nn.functional as F
from flame_core.autograd import no_grad
from flame_models.data.loader import PRESERVATION
from flame_models.training import preservation
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config
from .test_ai_toolkit_ui_config import ui_job

DOP = {"diff_output_preservation": True, "diff_output_preservation_class": "person"}
BLANK = {"blank_prompt_preservation": True}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return draw_images(tmp_path_factory.mktemp("dop") / "images", n_concept=2, n_other=2)


def _trainer(tmp_path, images, tiny_model, name, steps=4, **train):
    return Trainer(image_config(tmp_path, name, tiny_model, images, steps=steps, train=train), verbose=False)


@pytest.mark.parametrize("kind", ["class", "blank"])
def test_each_sample_carries_its_preservation_prompts_embeddings(tmp_path, images, tiny_model, kind):
    tr = _trainer(tmp_path, images, tiny_model, f"carry{kind}", **(DOP if kind == "class" else BLANK)).setup()
    data = tr.loader.dataset
    batch = tr.loader.next_batch()
    for b, caption in enumerate(batch["captions"]):
        assert "ohwx" in caption
        want = data.texts.load(caption.replace("ohwx", "person") if kind == "class" else "")
        for k, v in want.items():
            np.testing.assert_array_equal(batch[PRESERVATION + k][b], v, err_msg=k)
        for k, v in data.texts.load(caption).items():
            np.testing.assert_array_equal(batch[k][b], v, err_msg=k)


def _random_adapters(model, seed=0):
    g = np.random.default_rng(seed)
    with no_grad():
        for p in A.adapter_parameters(model):
            p.copy_(flame.tensor(g.standard_normal(tuple(p.shape)).astype(np.float32) * 0.05, device="cpu"))


def _grads(tr):
    return [p.grad.numpy().copy() for p in tr.params]


@pytest.mark.parametrize("kind, multiplier", [("diff_output", 0.0), ("diff_output", 2.5), ("blank_prompt", 1.5)])
def test_the_step_adds_the_preservation_mse_against_the_adapter_free_model(tmp_path, images, tiny_model, kind,
                                                                            multiplier):
    """On one micro-batch: the loss and the gradients are the run's (the same batch, noise and timesteps without
    preservation) plus multiplier x mse(model(preservation prompt), model without adapters(preservation prompt))'s."""
    tr = _trainer(tmp_path, images, tiny_model, f"step{kind}{multiplier}", **(DOP if kind == "diff_output" else BLANK),
                  **{f"{kind}_preservation_multiplier": multiplier}).setup()
    _random_adapters(tr.model)
    args, _ = tr._prepare(tr.loader.next_batch())
    loss = float(tr._forward_backward(*args))
    got = _grads(tr)
    tr.optimizer.zero_grad()
    # the same arguments without the preservation entries: the run's own loss and gradients
    keys = tr._cond_keys
    plain = [a for a, k in zip(args[3:], keys) if not k.startswith(PRESERVATION)]
    tr._cond_keys = tuple(k for k in keys if not k.startswith(PRESERVATION))
    main = float(tr._forward_backward(*args[:3], *plain))
    main_grads = _grads(tr)
    tr.optimizer.zero_grad()
    # the preservation term by hand
    kept = {k[len(PRESERVATION):]: a for a, k in zip(args[3:], keys) if k.startswith(PRESERVATION)}
    x_t = tr.objective.noisy(args[0], args[1], args[2])
    with no_grad():
        A.disable_adapters(tr.model)
        prior = tr.family.forward(tr.model, x_t, args[2], kept)
        A.enable_adapters(tr.model)
    term = F.mse_loss(tr.family.forward(tr.model, x_t, args[2], kept), prior) * multiplier
    term.backward()
    term_grads = _grads(tr)
    tr._cond_keys = keys
    assert float(term) > 0 or multiplier == 0
    np.testing.assert_allclose(loss, main + float(term), rtol=1e-5)
    for g, m, d in zip(got, main_grads, term_grads):
        np.testing.assert_allclose(g, m + d, rtol=1e-4, atol=1e-7)
    assert A.adapter_names(tr.model) == ["default"] and all(
        m.adapters_enabled for _, m in A.adapted_modules(tr.model))      # switched back on


def test_training_with_it_keeps_the_class_prompt_nearer_the_base_model(tmp_path, images, tiny_model):
    """Trained alike with and without it (12 steps), the class prompts' prediction drifts from the base model's
    (the adapters off) less with it, measured on one fixed batch of class prompts."""
    models = {}
    for on in (False, True):
        extra = {**DOP, "diff_output_preservation_multiplier": 4.0} if on else {}
        tr = _trainer(tmp_path, images, tiny_model, f"drift{on}", steps=12, lr=1e-2, **extra)
        assert np.isfinite(tr.train()["losses"]).all()
        models[on] = tr.model
    probe = _trainer(tmp_path, images, tiny_model, "probe", **DOP).setup()   # the class prompts' batch
    flame.manual_seed(7)
    args, _ = probe._prepare(probe.loader.next_batch())
    _, kept = preservation.split(dict(zip(probe._cond_keys, args[3:])))
    x_t = probe.objective.noisy(args[0], args[1], args[2])
    drift = {}
    with no_grad():
        for on, model in models.items():
            with preservation.adapters_off(model):
                prior = probe.family.forward(model, x_t, args[2], kept)
            drift[on] = float(F.mse_loss(probe.family.forward(model, x_t, args[2], kept), prior))
    assert 0 < drift[True] < 0.5 * drift[False], drift


def test_eager_and_graph_decisions(tmp_path, images, tiny_model):
    from flame_models.training.graphs import graph_plan
    assert graph_plan(1, 1 << 33, True, True, streamed_prior=True)[0] is False
    assert "output preservation (or a prior_reg dataset) under max_gpu_memory" in graph_plan(
        1, 1 << 33, True, True, streamed_prior=True)[1]
    assert graph_plan(1, None, True, True, streamed_prior=False) == (True, None)


@pytest.mark.parametrize("train, top, words", [
    ({"diff_output_preservation": True}, {}, r"train.diff_output_preservation_class: the class word"),
    (DOP, {"trigger_word": None}, r"train.diff_output_preservation: needs a trigger word"),
    ({**DOP, "diff_output_preservation_class": "ohwx"}, {}, r"'ohwx' is the trigger word itself"),
    ({**DOP, "diff_output_preservation_multiplier": -1}, {}, r"multiplier: the preservation loss's weight, >= 0"),
    ({**DOP, "train_text_encoder": True}, {}, r"not with train.train_text_encoder"),
    ({"diff_output_preservation_class": "person"}, {},
     r"train.diff_output_preservation_class: only used with train.diff_output_preservation: true"),
    ({"blank_prompt_preservation_multiplier": 2.0}, {},
     r"train.blank_prompt_preservation_multiplier: only used with train.blank_prompt_preservation: true"),
    ({**DOP, **BLANK}, {}, r"train.blank_prompt_preservation: give one of it and train.diff_output_preservation"),
    ({**BLANK, "train_text_encoder": True}, {}, r"train.blank_prompt_preservation: not with train.train_text_encoder"),
])
def test_config_mistakes_are_named(tmp_path, images, tiny_model, train, top, words):
    with pytest.raises(ConfigError, match=words):
        image_config(tmp_path, "bad", tiny_model, images, train=train, **top)


def test_precomputed_samples_and_full_fine_tunes_are_refused(tmp_path):
    base = {"name": "x", "training_folder": str(tmp_path), "trigger_word": "ohwx", "train": DOP,
            "model": {"size": "flux-tiny"}}
    with pytest.raises(ConfigError, match=r"needs image folders with captions"):
        config_from_dict({**base, "synthetic": {"num_samples": 2}})
    with pytest.raises(ConfigError, match=r"a full fine-tune trains the weights themselves"):
        config_from_dict({**base, "network": {"type": "full"}, "synthetic": {"num_samples": 2}})


def test_an_ai_toolkit_ui_job_with_it_trains(tmp_path, tiny_model):
    """The UI job with the checkbox on (its class "person", a trigger word): it trains; with it off, the class and
    multiplier the UI writes are warnings."""
    imgs = draw_images(tmp_path / "images", n_concept=2, n_other=1)
    job = ui_job(str(tmp_path / "out"), imgs, tiny_model)
    cfg = config_from_dict(job)
    assert any("diff_output_preservation_class: not used" in w for w in cfg.warnings)
    assert cfg.train.diff_output_preservation_class is None
    on = copy.deepcopy(job)
    proc = on["config"]["process"][0]
    proc["trigger_word"] = "ohwx"
    proc["train"]["diff_output_preservation"] = True
    cfg = config_from_dict(on)
    assert cfg.train.diff_output_preservation_class == "person"
    assert np.isfinite(Trainer(cfg, verbose=False).train()["losses"]).all()
    blank = copy.deepcopy(job)   # its other checkbox: blank prompt preservation (no trigger word needed)
    blank["config"]["process"][0]["name"] = "blank"
    blank["config"]["process"][0]["train"].update(blank_prompt_preservation=True,
                                                  blank_prompt_preservation_multiplier=1.0)
    cfg = config_from_dict(blank)
    assert cfg.train.blank_prompt_preservation and np.isfinite(Trainer(cfg, verbose=False).train()["losses"]).all()
