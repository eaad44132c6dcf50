"""Interrupts, in a child process running the example script: Ctrl-C finishes the step, saves and exits 130 saying
how to resume; a second Ctrl-C aborts at once; a process killed in the middle of a save leaves no half-written file
and the run resumes from the newest intact checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flame_core import io
from flame_models.training import checkpoint as ckpt
from flame_models.training.trainer import Trainer

from .conftest import tiny_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

CHILD = r"""
import os, sys, time
sys.path.insert(0, {repo!r})
import importlib.util
path = os.path.join({repo!r}, "examples", "train_flux_lora.py")
spec = importlib.util.spec_from_file_location("train_flux_lora", path)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
hook, arg = {hook!r}, {arg!r}
if hook == "checkpoint":      # sleep inside the checkpoint's temp folder, its tensors written, before state.json
    from flame_models.training import checkpoint
    real = checkpoint.atomic_write_json
    def slow(path, obj, **kw):
        if obj.get("step", 0) >= arg:
            print("SAVING", flush=True)
            time.sleep(60)
        return real(path, obj, **kw)
    checkpoint.atomic_write_json = slow
elif hook == "rename":        # sleep between a LoRA file's fsync and its rename
    real_replace = os.replace
    def slow_replace(a, b):
        if str(b).endswith(arg):
            print("SAVING", flush=True)
            time.sleep(60)
        return real_replace(a, b)
    os.replace = slow_replace
sys.exit(example.main(["--config", {config!r}] + {args!r}))
"""


def _config(tmp_path, steps, save_every):
    text = f"""
job: extension
config:
  name: run
  process:
    - training_folder: {tmp_path}
      device: cpu
      model: {{size: flux-tiny, dtype: fp32}}
      synthetic: {{num_samples: 8, height: 32, width: 32, text_length: 8}}
      network: {{type: lora, linear: 4, linear_alpha: 4, target: all_linear}}
      train: {{steps: {steps}, batch_size: 2, optimizer: adamw, lr: 3e-3, dtype: fp32, gradient_checkpointing: false,
               seed: 0}}
      sample: {{sample_every: 0}}
      save: {{save_every: {save_every}, dtype: fp32}}
"""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def _start(tmp_path, steps, save_every, hook=None, arg=None, args=()):
    code = CHILD.format(repo=REPO, hook=hook, arg=arg, config=_config(tmp_path, steps, save_every), args=list(args))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    err = open(tmp_path / "stderr.txt", "w")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err,
                            text=True)


def _wait_line(proc, text, timeout=60):
    t0 = time.time()
    lines = []
    while time.time() - t0 < timeout:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"the child never printed {text!r}: {lines}")


def _wait_rows(csv, n, proc, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(csv) and len(open(csv).read().splitlines()) > n:
            return
        assert proc.poll() is None, "the child ended early"
        time.sleep(0.05)
    raise AssertionError("the child made no progress")


def _no_half_written_file(run_dir):
    """Every file outside temp files / folders reads back whole."""
    for root, dirs, files in os.walk(run_dir):
        dirs[:] = [d for d in dirs if not d.endswith(".tmp")]
        for f in files:
            if f.endswith(".tmp"):
                continue
            p = os.path.join(root, f)
            if f.endswith(".safetensors"):
                io.load_file(p)
            elif f.endswith(".json"):
                with open(p) as fh:
                    json.load(fh)


def _resume_line(text, start):
    line = next(x for x in text.splitlines() if start in x)
    return line[line.index(start):]


def test_ctrl_c_finishes_the_step_saves_says_how_to_resume_and_exits_130(tmp_path):
    run = tmp_path / "run"
    proc = _start(tmp_path, steps=100000, save_every=100000, args=["--fresh"])
    _wait_rows(str(run / "loss.csv"), 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130, (out, err)
    assert "SIGINT: stopping after this step" in err and "Traceback" not in err
    resume = _resume_line(out, "to resume, run:")
    assert "--config" in resume and "--fr" not in resume   # following it must not delete the checkpoint
    assert "run the same command again without --fresh to resume" in out + err
    path, step, skipped = ckpt.latest_valid(str(run))
    assert path is not None and skipped == []
    rows = open(run / "loss.csv").read().splitlines()[1:]
    assert len(rows) == step >= 3                                 # every finished step is in the checkpoint
    for f in ("loss.png", "loss.json", f"run_{step:06d}.safetensors"):
        assert os.path.getsize(run / f) > 0, f
    _no_half_written_file(str(run))
    c = tiny_config(tmp_path, "run", steps=step + 2, train={"lr_warmup_steps": 0})
    tr = Trainer(c, verbose=False).setup()                       # the same run continues from there
    assert tr.step == step


def test_a_second_ctrl_c_aborts_at_once_even_during_the_save(tmp_path):
    run = tmp_path / "run"
    proc = _start(tmp_path, steps=100000, save_every=100000, hook="checkpoint", arg=1, args=["--fre"])
    _wait_rows(str(run / "loss.csv"), 2, proc)
    proc.send_signal(signal.SIGINT)
    _wait_line(proc, "SAVING")                                   # the interrupt's save is under way (and slow)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130 and time.time() - t0 < 20, err
    assert "aborting now" in err and "aborted: the steps since the last checkpoint are lost" in err
    resume = _resume_line(err, "aborted:")
    assert "--config" in resume and "--fr" not in resume
    assert ckpt.checkpoint_steps(str(run)) == []                  # the save never completed: no checkpoint claimed
    _no_half_written_file(str(run))


@pytest.mark.parametrize("where", ["checkpoint", "rename"])
def test_a_save_killed_midway_leaves_nothing_half_written_and_the_run_resumes(tmp_path, where):
    run = tmp_path / "run"
    arg = 6 if where == "checkpoint" else "run_000006.safetensors"
    proc = _start(tmp_path, steps=9, save_every=3, hook=where, arg=arg)
    _wait_line(proc, "SAVING")
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    _no_half_written_file(str(run))
    assert not (run / "run_000006.safetensors").exists()          # the LoRA of step 6 never appeared half-written
    if where == "checkpoint":                                    # killed inside the checkpoint: its .tmp folder only
        assert ckpt.checkpoint_steps(str(run)) == [3]
        assert os.path.isdir(run / "checkpoints" / "step_000006.tmp")
    else:                                                        # the checkpoint was complete, its LoRA was not
        assert ckpt.checkpoint_steps(str(run)) == [3, 6]
    want = 3 if where == "checkpoint" else 6
    c = tiny_config(tmp_path, "run", steps=9, train={"lr_warmup_steps": 0})
    tr = Trainer(c, verbose=False)
    result = tr.train()
    assert tr.resumed_from == ckpt.checkpoint_dir(str(run), want)
    assert [r["step"] for r in tr.loss_log.rows] == list(range(1, 10)) and result["steps"] == 9
    assert ckpt.checkpoint_steps(str(run)) == [3, 6, 9] and not os.path.exists(run / "checkpoints" /
                                                                               "step_000006.tmp")
    _no_half_written_file(str(run))
