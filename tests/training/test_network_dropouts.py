"""kohya's rank_dropout / module_dropout in a run: network.rank_dropout / module_dropout (or ai-toolkit's
network_kwargs, kohya's network_args names) reach every adapter the trainer makes -- the denoiser's, a pretrained
file's, the text encoders' --, the run trains with them, and bad values are config errors."""
import numpy as np
import pytest

import flame_nn.adapters as A
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


def test_the_dropouts_reach_every_adapter_and_the_run_trains(tmp_path):
    c = tiny_config(tmp_path, "drops", steps=4, network={"rank_dropout": 0.25, "module_dropout": 0.1})
    tr = Trainer(c, verbose=False).setup()
    ads = [ad for _, _, ad in A.adapter_modules(tr.model)]
    assert ads and {(ad.rank_dropout, ad.module_dropout) for ad in ads} == {(0.25, 0.1)}
    assert np.isfinite(tr.train()["losses"]).all()
    # ai-toolkit's place: network_kwargs (moved into the fields), and a pretrained file's adapters get them too
    path = str(tmp_path / "drops.safetensors")
    tr.save_lora(path)
    c2 = tiny_config(tmp_path, "kw", steps=3, drop=("network.linear", "network.linear_alpha", "network.target",
                                                    "network.type"),
                     network={"network_kwargs": {"rank_dropout": 0.5}, "pretrained_lora_path": path})
    assert c2.network.rank_dropout == 0.5 and c2.network.network_kwargs == {}
    tr2 = Trainer(c2, verbose=False).setup()
    assert {ad.rank_dropout for _, _, ad in A.adapter_modules(tr2.model)} == {0.5}


@pytest.mark.parametrize("network, words", [
    ({"rank_dropout": 1.0}, "network.rank_dropout: must be in [0, 1)"),
    ({"module_dropout": -0.1}, "network.module_dropout: must be in [0, 1)"),
    ({"type": "lokr", "rank_dropout": 0.1}, "network.rank_dropout: LoRA's, DoRA's and LoCon's"),
    ({"rank_dropout": 0.1, "network_kwargs": {"rank_dropout": 0.2}}, "differs from network.rank_dropout"),
    ({"network_kwargs": {"module_dropout": "x"}}, "network.network_kwargs.module_dropout: a number"),
])
def test_bad_dropouts_are_config_errors(tmp_path, network, words):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, "bad", network=network)
    assert words in str(e.value)


def test_full_fine_tuning_refuses_them(tmp_path):
    with pytest.raises(ConfigError, match="network.rank_dropout: an adapter setting"):
        tiny_config(tmp_path, "full", drop=("network.linear", "network.linear_alpha", "network.target"),
                    network={"type": "full", "rank_dropout": 0.1})


def test_a_step_that_draws_is_not_graphed():
    """A CUDA graph replays the draws of its capture: the adapters' dropouts leave the step eager (said why),
    instead of a capture that fails (and stops a multi-rank run)."""
    from flame_models.training.graphs import graph_plan
    use, why = graph_plan(1, None, True, True, "network.rank_dropout")
    assert not use and "network.rank_dropout draw random numbers inside the step" in why
    assert graph_plan(1, None, True, True) == (True, None)


@pytest.mark.gpu
def test_on_cuda_the_dropouts_train_eagerly(tmp_path):
    c = tiny_config(tmp_path, "cuda", steps=4, network={"rank_dropout": 0.25, "module_dropout": 0.1})
    c.device, c.train.dtype, c.model.dtype = "cuda", "bf16", "bf16"
    tr = Trainer(c, verbose=False).setup()
    assert tr.graphed is None
    assert np.isfinite(tr.train()["losses"]).all()
