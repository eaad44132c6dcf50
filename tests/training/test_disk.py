"""The run's saves against the free disk space of its folder, at set-up (training/disk.py): not one save fitting is
an error naming the folder and the sizes, before any step; the kept saves not fitting is a warning; the estimate
counts a full fine-tune's float32 weights, its optimizer's state and the written model."""
import shutil

import pytest

from flame_models.training import disk
from flame_models.training.run_folder import RunFolderError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config
from .test_full_finetune import full_config


def _free(monkeypatch, nbytes):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage._replace(free=nbytes))


def _need(tr):
    c = tr.cfg
    n = sum(p.numel() for p in tr.model.parameters()) if tr.full else sum(p.numel() for _, p in
                                                                           tr.named_adapter_parameters())
    return disk.save_bytes(tr.named_adapter_parameters(), optimizer=c.train.optimizer,
                           ema=c.train.ema_config.use_ema, output_bytes=n * 2)   # (save.dtype bf16 below)


def test_the_estimate_counts_weights_state_ema_and_the_file(tmp_path):
    tr = Trainer(full_config(tmp_path, "est", dtype="fp32"), verbose=False).setup()
    named = tr.named_adapter_parameters()
    count = sum(p.numel() for _, p in named)
    model = sum(p.numel() for p in tr.model.parameters())
    assert count == model   # every weight trains, in float32
    assert disk.save_bytes(named, optimizer="adamw", output_bytes=model * 2) == count * (4 + 8) + model * 2
    assert disk.save_bytes(named, optimizer="adamw8bit", ema=True) == count * (4 + 2 + 4)


def test_a_save_that_cannot_fit_is_refused_at_set_up(tmp_path, monkeypatch):
    probe = Trainer(full_config(tmp_path, "probe"), verbose=False).setup()
    need = _need(probe)
    _free(monkeypatch, need - 1)
    tr = Trainer(full_config(tmp_path, "small"), verbose=False)
    with pytest.raises(RunFolderError, match=r"save: one save of this run writes about .* more than the .* free on "
                                             r"the disk of .*small"):
        tr.setup()
    assert not (tmp_path / "small" / "checkpoints").exists()    # refused before any step or save


def test_kept_saves_that_cannot_fit_are_a_warning(tmp_path, monkeypatch, capsys):
    cfg = tiny_config(tmp_path, "warn", steps=4, save={"dtype": "bf16", "max_step_saves_to_keep": 3})
    probe = Trainer(tiny_config(tmp_path, "probe", steps=4, save={"dtype": "bf16"}), verbose=False).setup()
    need = _need(probe)
    _free(monkeypatch, 2 * need)
    Trainer(cfg, verbose=True).setup()
    out = capsys.readouterr().out
    assert "WARNING: save: the run keeps 3 saves" in out and "a later save will fail" in out
    _free(monkeypatch, 10 * need)
    Trainer(tiny_config(tmp_path, "fine", steps=4, save={"dtype": "bf16", "max_step_saves_to_keep": 3}),
            verbose=True).setup()
    assert "WARNING: save:" not in capsys.readouterr().out


def test_a_full_fine_tunes_save_is_checked_before_the_caches(tmp_path, monkeypatch, tiny_model):
    """A full fine-tune's save is the model's size: checked from the header before any latent or text embedding is
    cached, with the weights as the checkpoint holds them (float32)."""
    from flame_models.training import image_data

    from .conftest import draw_images, image_config
    cfg = image_config(tmp_path, "early", tiny_model, draw_images(tmp_path / "images", 2, 2), steps=2)
    cfg.network.type = "full"
    _free(monkeypatch, 1000)
    cached = []
    monkeypatch.setattr(image_data, "prepare", lambda *a, **k: cached.append(1))
    with pytest.raises(RunFolderError, match=r"one save of this run writes about"):
        Trainer(cfg, verbose=False).setup()
    assert not cached
