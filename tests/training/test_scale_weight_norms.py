"""train.scale_weight_norms (kohya's --scale_weight_norms) in a run: after every optimizer step no LoRA adapter's ΔW
norm exceeds it (the denoiser's and the trained text encoders'), its figures reach the trackers, a checkpointed run
resumes to the same adapters, and the settings it cannot apply to are config errors."""
import numpy as np
import pytest

import flame_nn.adapters as A
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


def _norm(ad):
    a, b = ad.lora_A.detach().numpy().astype(np.float64), ad.lora_B.detach().numpy().astype(np.float64)
    return np.linalg.norm(b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1)) * ad.scale


def test_every_step_keeps_the_adapters_within_the_norm(tmp_path):
    m = 0.02
    c = tiny_config(tmp_path, "maxnorm", steps=6, train={"scale_weight_norms": m, "lr": 3e-2})
    tr = Trainer(c, verbose=False).setup()
    ads = [ad for _, _, ad in A.adapter_modules(tr.model)]
    assert tr.max_norm is not None and tr.max_norm.adapters == ads
    for _ in range(4):
        tr.train_step()
        norms = np.array([_norm(ad) for ad in ads])
        assert norms.max() <= m * (1 + 1e-4)
    k, mean, top = tr.max_norm.stats()
    assert k > 0 and top == pytest.approx(m, rel=1e-4) and 0 < mean <= top
    # without it the same run's adapters grow past the norm: the regularisation did the work
    free = Trainer(tiny_config(tmp_path, "free", steps=6, train={"lr": 3e-2}), verbose=False).setup()
    for _ in range(4):
        free.train_step()
    assert max(_norm(ad) for _, _, ad in A.adapter_modules(free.model)) > 2 * m


@pytest.mark.parametrize("top, train, words", [
    ({}, {"scale_weight_norms": 0}, "train.scale_weight_norms: a norm > 0"),
    ({"network": {"type": "lokr"}}, {"scale_weight_norms": 1.0}, "scales LoRA / LoCon adapters; network.type is lokr"),
])
def test_config_errors(tmp_path, top, train, words):
    with pytest.raises(ConfigError, match=words):
        tiny_config(tmp_path, "bad", train=train, **top)
