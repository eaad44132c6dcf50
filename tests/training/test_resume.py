"""Resume: a changed config is applied or refused (never silently half-applied), damaged checkpoints are skipped for
the newest intact one, every checkpoint file is fsynced before the folder's rename, the training time, the loss log
and the samples grid continue where the checkpoint left them."""
import json
import os

import numpy as np
import pytest

from flame_core import io
from flame_models.training import checkpoint as ckpt
from flame_models.training.resume import ResumeError
from flame_models.training.run_folder import RunFolderError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


def _run(tmp_path, name, steps, save_every=3, **kw):
    c = tiny_config(tmp_path, name, steps=steps, **kw)
    c.save.save_every = save_every
    return c


def test_a_change_that_cannot_continue_the_run_is_refused_naming_the_fields(tmp_path):
    Trainer(_run(tmp_path, "r", 3), verbose=False).train()
    for change, fields in [(dict(network={"linear": 8}), ["network.linear 4 -> 8"]),
                           (dict(network={"type": "dora", "target": "attention"}),
                            ["network.type 'lora' -> 'dora'", "network.target 'all_linear' -> 'attention'"]),
                           (dict(synthetic={"num_samples": 16}), ["synthetic.num_samples 8 -> 16"]),
                           (dict(train={"batch_size": 4}), ["train.batch_size 2 -> 4"]),
                           (dict(model={"size": "flux-schnell"}), ["model.size 'flux-tiny' -> 'flux-schnell'"])]:
        c = _run(tmp_path, "r", 6, **change)
        with pytest.raises(ResumeError) as ei:
            Trainer(c, verbose=False).setup()
        msg = str(ei.value)
        assert "cannot continue this run" in msg and "--fresh" in msg, msg
        for f in fields:
            assert f in msg, (f, msg)


def test_a_change_that_can_apply_is_applied_and_said_and_config_json_tells_the_truth(tmp_path, capsys):
    Trainer(_run(tmp_path, "a", 3), verbose=False).train()           # lr 3e-3, warm-up 2, weight decay default
    c = _run(tmp_path, "a", 8, train={"lr": 1e-3, "lr_warmup_steps": 0, "max_grad_norm": 0.5,
                                      "optimizer_params": {"weight_decay": 0.05, "betas": [0.8, 0.9]}},
             sample={"sample_every": 4}, log_every=2)
    tr = Trainer(c, verbose=True).setup()
    said = capsys.readouterr().out
    assert "resuming with changed settings, applied from step 3 on" in said
    for piece in ("train.lr 0.003 -> 0.001", "train.steps 3 -> 8", "sample.sample_every 0 -> 4", "log_every 1 -> 2",
                  "train.optimizer_params {} -> {'weight_decay': 0.05, 'betas': [0.8, 0.9]}"):
        assert piece in said, piece
    g = tr.optimizer.param_groups[0]
    assert g["lr"] == pytest.approx(1e-3) and g["weight_decay"] == 0.05 and tuple(g["betas"]) == (0.8, 0.9)
    assert tr.scheduler.get_last_lr()[0] == pytest.approx(1e-3) and tr.step == 3
    with open(os.path.join(c.output_dir, "config.json")) as f:
        written = json.load(f)
    assert written["train"]["lr"] == 1e-3 and written["train"]["optimizer_params"]["weight_decay"] == 0.05
    assert written["train"]["steps"] == 8 and written["device"] == "cpu"
    result = tr.train()
    assert result["steps"] == 8 and [r["step"] for r in tr.loss_log.rows] == [1, 2, 3, 4, 6, 8]  # log_every 2


def test_unchanged_config_resumes_with_the_checkpoints_hyperparameters_exactly(tmp_path):
    # lr changes along a linear schedule: the resumed schedule must sit exactly where the saved one was
    full = Trainer(_run(tmp_path, "s", 10, train={"lr_scheduler": "linear", "optimizer_params":
                                                  {"weight_decay": 0.1}}), verbose=False).setup()
    for _ in range(3):
        full.train_step()
    full.save_checkpoint()
    want = [full.train_step()[:2] for _ in range(3)]
    again = Trainer(_run(tmp_path, "s", 10, train={"lr_scheduler": "linear", "optimizer_params":
                                                   {"weight_decay": 0.1}}), verbose=False).setup()
    got = [again.train_step()[:2] for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-7)


def _two_checkpoints(tmp_path, name):
    c = _run(tmp_path, name, 6)
    Trainer(c, verbose=False).train()  # checkpoints at 3 and 6
    return c


@pytest.mark.parametrize("damage", ["empty state.json", "truncated adapter", "no manifest", "bad hash"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, damage, capsys):
    c = _two_checkpoints(tmp_path, "d")
    newest = ckpt.checkpoint_dir(c.output_dir, 6)
    if damage == "empty state.json":
        open(os.path.join(newest, "state.json"), "w").close()
        why = "state.json has 0 bytes, the manifest says"
    elif damage == "truncated adapter":
        p = os.path.join(newest, "adapter.safetensors")
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)
        why = "adapter.safetensors has"
    elif damage == "no manifest":
        os.remove(os.path.join(newest, "manifest.json"))
        why = "no manifest.json"
    else:
        p = os.path.join(newest, "optimizer.safetensors")
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) - 4)
            f.write(b"\x01\x02\x03\x04")
        why = "optimizer.safetensors does not match its SHA-256"
    tr = Trainer(_run(tmp_path, "d", 6), verbose=True).setup()
    out = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: {why}" in out, out
    assert tr.step == 3 and tr.resumed_from == ckpt.checkpoint_dir(c.output_dir, 3)
    assert [r["step"] for r in tr.loss_log.rows] == [1, 2, 3]
    tr.train()                                                     # saves step 6 again, over the damaged one
    assert ckpt.verify(newest) is None


def test_every_file_is_fsynced_before_the_folder_is_renamed_and_a_manifest_lists_them(tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name fsynced file descriptors")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.realpath(a), os.path.realpath(b)))
        return real_replace(a, b)
    tr = Trainer(_run(tmp_path, "f", 3), verbose=False).setup()
    for _ in range(3):
        tr.train_step()
    tr.progress = None
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = os.path.realpath(tr.save_checkpoint())
    monkeypatch.undo()
    tmp = final + ".tmp"
    rename = events.index(("replace", tmp, final))
    with open(os.path.join(final, "manifest.json")) as f:
        manifest = json.load(f)["files"]
    assert sorted(manifest) == ["adapter.safetensors", "optimizer.safetensors", "state.json"]
    for name, entry in manifest.items():
        # each file: fsynced (under its temp name), renamed into the temp folder, all before the folder's rename
        renamed = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == os.path.join(tmp, name)]
        assert renamed and renamed[0] < rename, name
        synced = [i for i, e in enumerate(events[:renamed[0]]) if e[0] == "fsync"
                  and e[1] == events[renamed[0]][1]]
        assert synced, name
        assert entry["size"] == os.path.getsize(os.path.join(final, name))
        assert entry["sha256"] == ckpt.sha256(os.path.join(final, name))
    assert ("fsync", tmp) in events[:rename] and ("fsync", os.path.dirname(final)) in events[rename:]


def test_only_the_newest_checkpoints_are_kept_with_their_loras(tmp_path):
    c = _run(tmp_path, "k", 12, save_every=2)
    c.save.max_step_saves_to_keep = 2
    Trainer(c, verbose=False).train()
    assert ckpt.checkpoint_steps(c.output_dir) == [10, 12]
    loras = sorted(f for f in os.listdir(c.output_dir) if f.endswith(".safetensors"))
    assert loras == ["k.safetensors", "k_000010.safetensors", "k_000012.safetensors"]


def test_training_time_loss_log_and_samples_grid_continue_after_resume(tmp_path):
    def c(steps):
        return _run(tmp_path, "t", steps, save_every=4, sample={"sample_every": 2, "sample_steps": 2,
                                                                "num_samples": 2})
    first = Trainer(c(4), verbose=False)
    first.train()
    t4 = first.active_time
    assert t4 > 0 and first.loss_log.rows[-1]["seconds"] == pytest.approx(t4)
    with open(first.loss_log.csv_path) as f:                     # rows written after the checkpoint: cut on resume
        extra = f.read()
    with open(first.loss_log.csv_path, "a") as f:
        f.write(extra.splitlines()[-1].replace("4,", "5,", 1) + "\r\n")

    again = Trainer(c(6), verbose=False).setup()
    assert again.active_time == pytest.approx(t4)
    assert [s for s, _ in again.previews.history] == [0, 2, 4]
    result = again.train()
    rows = again.loss_log.rows
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    seconds = [r["seconds"] for r in rows]
    assert seconds[4] > t4 and seconds == sorted(seconds)          # the clock continued, it did not restart
    assert [s for s, _ in again.previews.history] == [0, 2, 4, 6]
    assert os.path.isfile(result["samples"])
    assert again.previews.grid_columns == ["data", "step 0", "step 2", "step 4", "step 6"]


def test_a_folder_with_outputs_but_no_checkpoint_is_refused_unless_fresh(tmp_path):
    c = _run(tmp_path, "o", 3, save_every=100)
    Trainer(c, verbose=False).train()                            # the final step saves: remove it to leave outputs
    import shutil
    shutil.rmtree(os.path.join(c.output_dir, "checkpoints"))
    with pytest.raises(RunFolderError, match="no intact checkpoint to resume from.*--fresh"):
        Trainer(_run(tmp_path, "o", 3, save_every=100), verbose=False).setup()
    keep = os.path.join(c.output_dir, "notes.txt")
    open(keep, "w").write("mine")
    tr = Trainer(_run(tmp_path, "o", 3, save_every=100), verbose=False, fresh=True).setup()
    assert tr.step == 0 and not os.path.exists(os.path.join(c.output_dir, "loss.csv"))
    assert open(keep).read() == "mine"                           # --fresh removes the trainer's outputs only


def test_ema_resumes_exactly_and_the_lora_holds_the_average(tmp_path):
    def c():
        return _run(tmp_path, "ema", 8, train={"ema_config": {"use_ema": True, "ema_decay": 0.9}})
    full = Trainer(c(), verbose=False).setup()
    for _ in range(3):
        full.train_step()
    full.save_checkpoint()
    for _ in range(2):
        full.train_step()
    want = [s.numpy().copy() for s in full.ema.shadow]
    again = Trainer(c(), verbose=False).setup()
    assert again.ema.num_updates == 3
    for _ in range(2):
        again.train_step()
    for a, b in zip(again.ema.shadow, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-6, atol=1e-8)
    from flame_nn import adapters as A
    live_before = [p.detach().numpy().copy() for p in again.params]
    lora = io.load_file(again.save_lora(str(tmp_path / "ema.safetensors")))
    for p, v in zip(again.params, live_before):                   # the live values are back after the save
        np.testing.assert_array_equal(p.detach().numpy(), v)
    kw = dict(name_map=again.name_map, dtype="float32")
    live = io.load_file(A.save_adapters(again.model, str(tmp_path / "live.safetensors"), "kohya", **kw))
    with again.ema.swapped():
        avg = io.load_file(A.save_adapters(again.model, str(tmp_path / "avg.safetensors"), "kohya", **kw))
    ups = [k for k in lora if k.endswith(".lora_up.weight")]
    assert all(np.array_equal(lora[k].numpy(), avg[k].numpy()) for k in ups)
    assert any(not np.allclose(lora[k].numpy(), live[k].numpy()) for k in ups)


@pytest.mark.parametrize("force, want", [(True, [4, 6]), (False, [6])])
def test_force_first_sample_samples_where_a_resumed_run_starts(tmp_path, force, want):
    """ai-toolkit's force_first_sample: a resumed run samples before its first step (the step's grid column is
    replaced, not doubled); without it, at its sample_every steps only."""
    def c(steps):
        return _run(tmp_path, "f", steps, save_every=4, sample={"sample_every": 2, "sample_steps": 2,
                                                                "num_samples": 1},
                    train={"force_first_sample": force})
    first = c(4)
    first.train.force_first_sample = False   # (an applicable change: asked for when resuming)
    Trainer(first, verbose=False).train()
    again = Trainer(c(6), verbose=False).setup()
    seen, real = [], again.sample
    again.sample = lambda: (seen.append(again.step), real())[1]
    again.train()
    assert seen == want
    assert [s for s, _ in again.previews.history] == [0, 2, 4, 6]
