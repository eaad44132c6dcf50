"""Non-finite training stops the run: a poisoned sample's NaN loss ends training naming the step and the file, no
checkpoint or LoRA of it is written, the good checkpoints are kept, the example exits 2; the flags are read only
where results are written; NaN / inf gradients and parameters are caught too."""
import importlib.util
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import io
from flame_models.data import write_sample
from flame_models.training import checkpoint as ckpt
from flame_models.training.finite import FiniteGuard, NonFiniteError
from flame_models.training.trainer import Trainer

from .conftest import make_samples, tiny_config

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_flux_lora.py")


def _poisoned_samples(folder, bad=6, n=8):
    """n sample files in file order; sample `bad`'s latents hold a NaN (a poisoned cache entry / sample file)."""
    make_samples(folder, n=n, txt=(8, 32), pooled=16)
    path = str(folder / f"{bad:04d}.safetensors")
    with io.safe_open(path) as f:
        names = f.keys()
        arrays = {k: f.get_array(k) for k in names}
    arrays["latents"][0, 1, 1] = np.nan
    write_sample(path, **arrays)
    return str(folder), path


def _config(tmp_path, name, data, **kw):
    # unshuffled: batches of 2 in file order, so sample 6 is in step 4's batch
    return tiny_config(tmp_path, name, steps=6, datasets=[{"folder_path": data, "shuffle": False}], synthetic=None,
                       save={"save_every": 1, "max_step_saves_to_keep": 2}, **kw)


def test_a_nan_loss_stops_the_run_naming_step_and_file_and_keeps_the_good_checkpoints(tmp_path):
    data, bad = _poisoned_samples(tmp_path / "data")
    c = _config(tmp_path, "nan", data)
    tr = Trainer(c, verbose=False)
    with pytest.raises(NonFiniteError) as ei:
        tr.train()
    msg = str(ei.value)
    assert msg.startswith("step 4: the loss and the gradients became NaN or infinite") and bad in msg, msg
    assert tr.step == 4
    assert ckpt.checkpoint_steps(c.output_dir) == [2, 3]          # step 4 never saved; the good ones not pruned
    assert ckpt.latest_valid(c.output_dir)[1] == 3
    for s in (2, 3):
        for name in ("adapter.safetensors", "optimizer.safetensors"):
            for v in io.load_file(os.path.join(ckpt.checkpoint_dir(c.output_dir, s), name)).values():
                assert np.isfinite(v.numpy()).all()
    assert not os.path.exists(os.path.join(c.output_dir, "nan.safetensors"))   # no final LoRA
    assert not os.path.exists(os.path.join(c.output_dir, "nan_000004.safetensors"))
    with open(os.path.join(c.output_dir, "loss.csv")) as f:
        assert [line.split(",")[0] for line in f.read().split()[1:]] == ["1", "2", "3"]  # no NaN row


def test_the_example_exits_2_with_one_line_naming_the_file(tmp_path, capsys, flux_file):
    spec = importlib.util.spec_from_file_location("train_flux_lora", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data, bad = _poisoned_samples(tmp_path / "data", bad=0, n=4)
    args = ["--model", flux_file, "--data", data, "--output", str(tmp_path), "--name", "x", "--sample-every", "0",
            "--optimizer", "adamw", "--rank", "4", "--steps", "3", "--batch-size", "4"]
    assert example.main(args) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and line[0].startswith("error: step ") and "became NaN or infinite" in line[0], err
    assert bad in line[0] and "Traceback" not in err


def test_the_flags_are_read_only_where_results_are_written(tmp_path, monkeypatch):
    reads = []
    real = FiniteGuard.check

    def check(self, dataset=None):
        reads.append(tr.step)
        return real(self, dataset)
    monkeypatch.setattr(FiniteGuard, "check", check)
    c = tiny_config(tmp_path, "quiet", steps=6, log_every=3, save={"save_every": 3})
    tr = Trainer(c, verbose=False)
    tr.train()
    # steps 3 and 6: the loss-log row, then the checkpoint and its LoRA; step 6 also the final LoRA
    assert sorted(set(reads)) == [3, 6] and reads.count(3) == 3


def test_non_finite_gradients_are_caught_with_the_step_and_its_samples():
    p = flame_nn.Parameter(flame.ones(4))
    q = flame_nn.Parameter(flame.ones(2))
    guard = FiniteGuard([p, q], p.device)  # the parameters' device (cuda in a FLAME_DEVICE=cuda run)
    ((p * 2).sum() + q.sum()).backward()
    guard.watch_loss(flame.tensor(1.0))
    guard.after_backward(1, [0, 1], ["a cat"])
    guard.check()                                                   # all finite: nothing
    p.grad.copy_(flame.tensor([1.0, float("inf"), 0.0, 0.0]))       # e.g. an overflow in backward
    guard.watch_loss(flame.tensor(2.0))
    guard.after_backward(2, [2, 3], ["a dog"])
    guard.after_backward(3, [4, 5], ["a bird"])                     # later steps do not replace the first
    with pytest.raises(NonFiniteError, match=r"^step 2: the gradients became NaN .*the step.s samples: dataset "
                                             r"items \[2, 3\]; captions: \['a dog'\]"):
        guard.check()


def test_non_finite_parameters_are_never_saved(tmp_path):
    tr = Trainer(tiny_config(tmp_path, "p", steps=4), verbose=False).setup()
    tr.train_step()
    with flame.autograd.no_grad():
        tr.params[0].fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="after step 1: 1 of .* trained parameter tensors hold NaN"):
        tr.save_checkpoint()
    assert ckpt.checkpoint_steps(tr.out) == []
