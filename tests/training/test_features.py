"""Trainer features tested through the trainer: gradient accumulation, AdamW8bit through a checkpoint, sampling during
training (progress, size, no effect on training), log_every, per-dataset shuffle, the ETA across pauses."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models.data import ConcatDataset, SyntheticDataset
from flame_models.data import SampleLoader as Loader
from flame_models.training import progress as P
from flame_models.training import trainer as T
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import make_samples, tiny_config


def test_n_micro_batches_equal_one_batch_of_n(tmp_path):
    runs = []
    for bs, accum in ((4, 1), (1, 4), (2, 2)):
        tr = Trainer(tiny_config(tmp_path, f"acc{bs}", train={"batch_size": bs, "gradient_accumulation_steps": accum,
                                                              "max_grad_norm": 0.05}), verbose=False).setup()
        losses = [tr.train_step()[0] for _ in range(3)]
        runs.append((losses, [p.detach().numpy().copy() for p in tr.params]))
    for losses, params in runs[1:]:
        np.testing.assert_allclose(losses, runs[0][0], rtol=1e-5)
        for a, b in zip(params, runs[0][1]):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


def test_adamw8bit_state_is_8bit_and_resumes_exactly_through_a_checkpoint(tmp_path):
    def c():  # rank 16: the up matrices of the MLP Linears have >= 4096 elements, the 8-bit threshold
        return tiny_config(tmp_path, "8bit", steps=10, train={"optimizer": "adamw8bit"},
                           network={"linear": 16, "linear_alpha": 16})
    full = Trainer(c(), verbose=False).setup()
    threshold = full.optimizer.param_groups[0]["min_8bit_size"]
    assert any(p.numel() >= threshold for p in full.params) and any(p.numel() < threshold for p in full.params)
    for _ in range(3):
        full.train_step()
    path = full.save_checkpoint()
    state = io.load_file(f"{path}/optimizer.safetensors")
    assert any(v.dtype == flame.uint8 for v in state.values()) and any(k.endswith("absmax") for k in state)
    want = [full.train_step()[0] for _ in range(3)]
    want_p = [p.detach().numpy().copy() for p in full.params]
    again = Trainer(c(), verbose=False).setup()
    assert again.step == 3
    np.testing.assert_allclose([again.train_step()[0] for _ in range(3)], want, rtol=1e-6)
    for a, b in zip(again.params, want_p):
        np.testing.assert_allclose(a.detach().numpy(), b, rtol=1e-6, atol=1e-8)


def test_sampling_during_training_writes_each_step_shows_progress_and_leaves_training_untouched(tmp_path, capsys,
                                                                                               monkeypatch):
    from flame_models.training import samples as S
    plain = Trainer(tiny_config(tmp_path, "nosample", steps=4), verbose=False).train()
    bars, real_bar = [], S._bar
    monkeypatch.setattr(S, "_bar", lambda *a: bars.append(real_bar(*a)) or bars[-1])
    c = tiny_config(tmp_path, "sample", steps=4, sample={"sample_every": 2, "sample_steps": 3, "num_samples": 2})
    tr = Trainer(c, verbose=True)
    result = tr.train()
    np.testing.assert_array_equal(result["losses"], plain["losses"])
    err = capsys.readouterr().err
    assert "sample @ 0" in err and "sample @ 2" in err and "sample @ 4" in err
    assert [(b.n, b.total) for b in bars] == [(6, 6)] * 3          # 2 prompts x 3 steps, step by step
    folder = tmp_path / "sample" / "samples"
    for s in (0, 2, 4):
        assert (folder / f"step_{s:06d}.png").stat().st_size > 0
        lat = io.load_file(str(folder / f"step_{s:06d}.safetensors"))["latents"]
        assert tuple(lat.shape) == (2, 16, 4, 4)                  # the 32 px synthetic data's size
    assert [s for s, _ in tr.previews.history] == [0, 2, 4]


def test_sample_size_defaults_to_the_datasets_resolution(tmp_path, flux_file):
    data = make_samples(tmp_path / "data", h=4, w=6)               # 32 x 48 px
    c = tiny_config(tmp_path, "size", steps=1, train={"lr_warmup_steps": 0}, synthetic=None,
                    datasets=[{"folder_path": data}],
                    model={"name_or_path": flux_file, "size": None},
                    sample={"sample_every": 1, "sample_steps": 2, "num_samples": 1})
    tr = Trainer(c, verbose=False)
    tr.train()
    assert (c.sample.height, c.sample.width) == (32, 48)
    assert tr.previews.history[0][1][0].shape == (16, 4, 6)
    c2 = tiny_config(tmp_path, "size2", steps=1, train={"lr_warmup_steps": 0}, synthetic=None,
                     datasets=[{"folder_path": data}],
                     model={"name_or_path": flux_file, "size": None},
                     sample={"sample_every": 1, "sample_steps": 2, "num_samples": 1, "width": 16, "height": 32})
    tr = Trainer(c2, verbose=False)
    tr.train()
    assert tr.previews.history[0][1][0].shape == (16, 4, 2)       # given sizes win


def test_log_every_writes_the_mean_of_each_window_and_continues_it_across_a_resume(tmp_path, monkeypatch):
    every = Trainer(tiny_config(tmp_path, "every", steps=8), verbose=False).train()["losses"]
    want = [np.mean(every[0:3]), np.mean(every[3:6]), np.mean(every[6:8])]
    got = Trainer(tiny_config(tmp_path, "windows", steps=8, log_every=3), verbose=False)
    got.train()
    assert [r["step"] for r in got.loss_log.rows] == [3, 6, 8]
    np.testing.assert_allclose([r["loss"] for r in got.loss_log.rows], want, rtol=1e-6)

    # a crash after step 5: the checkpoint at 4 holds step 4 of the window 4..6, the resumed run completes it
    def c():
        return tiny_config(tmp_path, "crash", steps=8, log_every=3, save={"save_every": 4})
    first = Trainer(c(), verbose=False)
    real = Trainer.train_step

    def crashing(self):
        if self.step == 5:
            raise RuntimeError("pretend: the machine went away")
        return real(self)
    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(RuntimeError, match="went away"):
        first.train()
    monkeypatch.setattr(Trainer, "train_step", real)
    again = Trainer(c(), verbose=False)
    again.train()
    assert again.resumed_from and [r["step"] for r in again.loss_log.rows] == [3, 6, 8]
    np.testing.assert_allclose([r["loss"] for r in again.loss_log.rows], want, rtol=1e-6)


def test_each_datasets_shuffle_flag_is_used(tmp_path):
    a = make_samples(tmp_path / "a", n=4, seed=1)
    b = make_samples(tmp_path / "b", n=6, seed=2)
    c = tiny_config(tmp_path, "two", synthetic=None, datasets=[{"folder_path": a}, {"folder_path": b,
                                                                                    "shuffle": False}])
    tr = Trainer(c, verbose=False).setup()
    assert tr.loader.shuffle == [True, False]
    order = tr.loader._order_for(0)
    assert sorted(order) == list(range(10))
    assert [i for i in order if i >= 4] == [4, 5, 6, 7, 8, 9]      # the unshuffled folder keeps its file order
    assert [i for i in order if i < 4] != [0, 1, 2, 3] or [i for i in tr.loader._order_for(1) if i < 4] != [0, 1, 2, 3]
    assert list(Loader(ConcatDataset([SyntheticDataset(4), SyntheticDataset(6)]), shuffle=[False, False])
                ._order_for(3)) == list(range(10))
    one = Loader(SyntheticDataset(8), shuffle=True, seed=5)         # one dataset: a permutation from (seed, epoch)
    np.testing.assert_array_equal(one._order_for(2), np.random.default_rng([5, 2]).permutation(8))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0                                             # every reading: one second of training
        return self.now


def test_pauses_for_sampling_and_saving_are_not_training_time_and_the_eta_ignores_them(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(T, "Progress", lambda *a, **k: P.Progress(*a, clock=clock, **k))
    real_run = T.Previews.run

    def slow_run(self, *a, **k):
        clock.now += 1000.0                                        # a very slow sampling round
        return real_run(self, *a, **k)
    monkeypatch.setattr(T.Previews, "run", slow_run)
    c = tiny_config(tmp_path, "eta", steps=6, sample={"sample_every": 3, "sample_steps": 1, "num_samples": 1})
    tr = Trainer(c, verbose=False)
    tr.train()
    seconds = [r["seconds"] for r in tr.loss_log.rows]
    assert seconds[-1] < 20 and all(0 < b - a < 5 for a, b in zip(seconds, seconds[1:])), seconds
    assert tr.progress.rate is not None and tr.progress.rate > 0.1   # not folded into a pause of 1000 s

    # after a resume the ETA is known before the first step: the earlier part's pace
    again = Trainer(tiny_config(tmp_path, "eta", steps=12, sample={"sample_every": 3, "sample_steps": 1,
                                                                   "num_samples": 1}), verbose=False).setup()
    pr = P.Progress(12, initial=again.step, active_time=again.active_time, enabled=False)
    assert again.active_time == pytest.approx(seconds[-1])
    assert pr.eta == pytest.approx(6 / (6 / seconds[-1]))


def test_progress_eta_counts_active_time_only():
    clock = FakeClock()
    pr = P.Progress(10, enabled=False, clock=clock)
    pr.start()
    for _ in range(3):
        pr.update(1)
    with pr.paused():
        clock.now += 500.0
    pr.update(1)
    assert pr.active_time == pytest.approx(5.0)                   # 1 s per step, 2 for the one with a pause
    assert pr.eta < 30 and pr.rate > 0.3


@pytest.mark.parametrize("dataset_device", ["cpu"])
def test_objective_timesteps_follow_the_config(tmp_path, dataset_device):
    tr = Trainer(tiny_config(tmp_path, "ts", train={"timestep_type": "shift", "shift": 5.0}), verbose=False).setup()
    g = flame.Generator("cpu").manual_seed(0)
    s = tr.objective.sample_timesteps(20000, generator=g, num_tokens=4, device="cpu").numpy()
    assert np.median(s) == pytest.approx(5 * 0.5 / (1 + 4 * 0.5), abs=0.01)   # the shifted median of sigmoid(N)


def _max_grads_at_step(tr, monkeypatch):
    """The largest |gradient| and the gradients' global norm the optimizer's next step sees."""
    seen = []
    step = tr.optimizer.step

    def spy(*a, **k):
        grads = [p.grad.numpy().astype(np.float64) for p in tr.params if p.grad is not None]
        seen.append((max(float(np.abs(g).max()) for g in grads), float(np.sqrt(sum((g * g).sum() for g in grads)))))
        return step(*a, **k)
    monkeypatch.setattr(tr.optimizer, "step", spy)
    tr.train_step()
    return seen[0]


def test_max_grad_value_clamps_every_gradient_before_the_step(tmp_path, monkeypatch):
    """train.max_grad_value (torch's clip_grad_value_, SimpleTuner's grad_clip_method value): no gradient the step
    sees is beyond it; without it they are; max_grad_norm is then 0 unless given, and given, it clips the clamped
    gradients by their norm."""
    plain = Trainer(tiny_config(tmp_path, "gv0", train={"max_grad_norm": 0}), verbose=False).setup()
    assert _max_grads_at_step(plain, monkeypatch)[0] > 1e-4
    tr = Trainer(tiny_config(tmp_path, "gv", train={"max_grad_value": 1e-4}), verbose=False).setup()
    assert tr.cfg.train.max_grad_norm == 0.0
    top, _ = _max_grads_at_step(tr, monkeypatch)
    assert 0 < top <= 1e-4 * (1 + 1e-6)
    both = Trainer(tiny_config(tmp_path, "gv2", train={"max_grad_value": 1e-4, "max_grad_norm": 1e-4}),
                   verbose=False).setup()
    top, norm = _max_grads_at_step(both, monkeypatch)
    assert top <= 1e-4 * (1 + 1e-6) and norm <= 1e-4 * (1 + 1e-4)
    with pytest.raises(ConfigError, match=r"train.max_grad_value: null \(no clipping by value\) or a number > 0, "
                                          r"got -1"):
        tiny_config(tmp_path, "bad", train={"max_grad_value": -1})
