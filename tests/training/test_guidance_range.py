"""train.guidance_range (SimpleTuner's flux_guidance_mode random-range): each sample's embedded guidance drawn
uniformly in [min, max] from the timesteps' random stream -- the same draws for the same seed, train.guidance for
every sample without it -- and the settings checked before anything loads."""
import numpy as np
import pytest

from flame_models.training.config import ConfigError
from flame_models.training.family import get_family
from flame_models.training.simpletuner_config import read_simpletuner_config
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config


@pytest.fixture
def images(tmp_path):
    return draw_images(tmp_path / "img")


def _guidances(tmp_path, images, name, monkeypatch, **train):
    fam = get_family("flux")
    seen = []
    forward = fam.forward

    def spy(model, x_t, t, cond):
        seen.append(np.asarray(cond["guidance"].float().numpy()).copy())
        return forward(model, x_t, t, cond)
    monkeypatch.setattr(fam, "forward", spy)
    cfg = image_config(tmp_path, name, None, images, steps=3, model={"name_or_path": None}, train=train)
    result = Trainer(cfg, verbose=False).train()
    monkeypatch.undo()
    return seen, result


def test_each_sample_draws_its_guidance_in_the_range(tmp_path, images, monkeypatch):
    drawn, result = _guidances(tmp_path, images, "a", monkeypatch, guidance_range=[1.5, 4.0])
    g = np.concatenate(drawn)
    assert len(drawn) == 3 and g.size == 6 and np.all((1.5 <= g) & (g <= 4.0)) and len(set(g.round(5))) == 6
    again, _ = _guidances(tmp_path, images, "b", monkeypatch, guidance_range=[1.5, 4.0])
    np.testing.assert_array_equal(np.concatenate(again), g)          # the seed's stream: the same draws
    plain, base = _guidances(tmp_path, images, "c", monkeypatch, guidance=2.0)
    assert np.all(np.concatenate(plain) == 2.0)
    assert np.isfinite(result["losses"]).all() and result["losses"] != base["losses"]


@pytest.mark.parametrize("train, model, words", [
    ({"guidance_range": [4, 1]}, {}, r"train.guidance_range: \[min, max\], two numbers with 0 <= min <= max"),
    ({"guidance_range": [1]}, {}, r"train.guidance_range: \[min, max\]"),
    ({"guidance_range": [1, "x"]}, {}, r"train.guidance_range: \[min, max\]"),
    ({"guidance_range": [1, 3], "guidance": 2}, {}, r"train.guidance: train.guidance_range draws each sample's"),
    ({"guidance_range": [1, 3], "bypass_guidance_embedding": True}, {},
     r"train.guidance_range: not used: train.bypass_guidance_embedding"),
    ({"guidance_range": [1, 3]}, {"arch": "sd3"}, r"train.guidance_range: not available"),
])
def test_bad_settings_are_named(tmp_path, images, train, model, words):
    with pytest.raises(ConfigError, match=words):
        cfg = image_config(tmp_path, "bad", None, images, model={"name_or_path": None, **model}, train=train)
        Trainer(cfg, verbose=False).setup()


def test_simpletuners_random_range(tmp_path):
    import json
    folder = tmp_path / "st"
    folder.mkdir()
    (folder / "multidatabackend.json").write_text(json.dumps([
        {"id": "x", "type": "local", "instance_data_dir": "/data", "caption_strategy": "textfile"}]))
    base = {"model_family": "flux", "model_type": "lora", "output_dir": "out", "max_train_steps": 10,
            "data_backend_config": "multidatabackend.json", "flux_guidance_mode": "random-range",
            "optimizer": "adamw_bf16", "num_train_epochs": 0}
    for extra, want in (({}, [0.0, 4.0]), ({"flux_guidance_min": 1, "flux_guidance_max": "3.5"}, [1, 3.5])):
        (folder / "config.json").write_text(json.dumps({**base, **extra}))
        proc, _ = read_simpletuner_config(str(folder / "config.json"))
        assert proc["train"]["guidance_range"] == want and "guidance" not in proc["train"]
