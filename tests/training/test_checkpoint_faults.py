"""Fault injection: a training process killed (SIGKILL) at each point of a checkpoint save -- a new step, and a step
saved again -- then run again, ends with exactly the parameters and optimizer state of a run that never stopped, and
a loss log with every step once.

The killed run is a forked child (no Python clean-up runs after SIGKILL, as with a real kill); the crash point is
`checkpoint.crash_point`, replaced in the child only. `kill_and_resume` is also what the kill-point table in the
reliability notes was made with."""
import os
import shutil
import signal

import numpy as np
import pytest

import flame_core
from flame_models.training import checkpoint as ckpt
from flame_models.training.run_folder import RunFolderError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")

# every crash point of a save, in order, and one inside a file's write (half of optimizer.safetensors on disk)
POINTS = ["begin", "folder", "file:adapter.safetensors", "mid-write:optimizer.safetensors",
          "file:optimizer.safetensors", "state", "manifest", "synced", "old-moved", "renamed", "root-synced", "done"]
STEPS, EVERY = 6, 3


def _config(tmp_path, name):
    c = tiny_config(tmp_path, name, steps=STEPS)
    c.save.save_every = EVERY
    return c


def _final_state(tr):
    """The adapters' values and the optimizer's tensors and scalars after training, as numpy / python values."""
    params = {k: p.detach().numpy().copy() for k, p in tr.named_adapter_parameters()}
    opt = {f"{i}.{k}": (v.detach().numpy().copy() if isinstance(v, flame_core.Tensor) else v)
           for i, st in tr.optimizer.state_dict()["state"].items() for k, v in st.items()}
    return params, opt


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A run that never stopped: its folder (checkpoints at 3 and 6) and its final state."""
    c = _config(tmp_path_factory.mktemp("ref"), "run")
    tr = Trainer(c, verbose=False)
    tr.train()
    return c.output_dir, _final_state(tr)


def _run_child(c, point, at_step):
    """Train `c` in a forked child that is killed at `point` of the save of step `at_step`. Returns whether it was
    killed there (False: it finished without reaching the point)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            tr = Trainer(c, verbose=False, handle_signals=False)
            real_point, real_save = ckpt.crash_point, flame_core.io.save_file

            def crash_point(name):
                real_point(name)
                if tr.step == at_step and name == point:
                    os.kill(os.getpid(), signal.SIGKILL)

            def save_file(tensors, path, *a, **kw):
                out = real_save(tensors, path, *a, **kw)
                if tr.step == at_step and point == f"mid-write:{os.path.basename(path)}":
                    with open(path, "r+b") as f:  # half the file written when the kill comes
                        f.truncate(os.path.getsize(path) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
                return out
            ckpt.crash_point, flame_core.io.save_file = crash_point, save_file
            tr.train()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the child failed (exit {os.WEXITSTATUS(status)})"
    return False


def disk(run_dir):
    """What the checkpoints folder holds: {entry: 'intact' | why not}."""
    root = ckpt.checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return {}
    return {e: (ckpt.verify(os.path.join(root, e)) or "intact") for e in sorted(os.listdir(root))}


def kill_and_resume(tmp_path, reference, scenario, point):
    """Kill a run at `point` of a save, run it again; returns a row of the kill-point table:
    (on disk after the kill, what recovery did, the step resumed from, exact?)."""
    ref_dir, (want_params, want_opt) = reference
    c = _config(tmp_path, "run")
    if scenario == "re-save":  # the run's folder as the reference left it, step 6 damaged: resume from 3 saves 6 again
        shutil.copytree(ref_dir, c.output_dir)
        p = os.path.join(ckpt.checkpoint_dir(c.output_dir, 6), "optimizer.safetensors")
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) - 4)
            f.write(b"\x01\x02\x03\x04")
        at_step = 6
    else:
        at_step = 6 if scenario == "new step" else 3
    killed = _run_child(c, point, at_step)
    on_disk = disk(c.output_dir)
    recovered = ckpt.recover(c.output_dir)
    try:
        tr = Trainer(c, verbose=False).setup()
    except RunFolderError as e:  # the first save was killed before it was whole: nothing to resume from
        assert "no intact checkpoint" in str(e) and "--fresh" in str(e)
        tr = Trainer(c, verbose=False, fresh=True).setup()
    resumed_at = tr.step
    tr.train()
    params, opt = _final_state(tr)
    exact = sorted(params) == sorted(want_params) and sorted(opt) == sorted(want_opt) and all(
        np.array_equal(params[k], want_params[k]) for k in params) and all(
        np.array_equal(opt[k], want_opt[k]) if isinstance(opt[k], np.ndarray) else opt[k] == want_opt[k]
        for k in opt)
    after = disk(c.output_dir)
    assert all(v == "intact" for v in after.values()), after  # no leftovers, nothing damaged kept
    exact = exact and [r["step"] for r in tr.loss_log.rows] == list(range(1, STEPS + 1))  # the loss log whole too
    return killed, on_disk, recovered, resumed_at, exact


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("scenario", ["first save", "new step", "re-save"])
def test_a_run_killed_at_any_point_of_a_save_resumes_exactly(tmp_path, reference, scenario, point):
    killed, on_disk, recovered, resumed_at, exact = kill_and_resume(tmp_path, reference, scenario, point)
    assert killed == (point != "old-moved" or scenario == "re-save"), (scenario, point)  # only a re-save moves
    assert exact, (scenario, point, on_disk, recovered, resumed_at)
    whole = POINTS.index(point) >= POINTS.index("manifest")  # the .tmp folder was complete at the kill
    at, before = (3, 0) if scenario == "first save" else (6, 3)
    assert resumed_at == (STEPS if not killed else at if whole else before)


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def test_recover_promotes_a_whole_tmp_restores_an_intact_old_and_removes_leftovers(tmp_path):
    run = str(tmp_path)

    def write(step, value):
        ckpt.write_checkpoint(run, step, {"x.bin": lambda p: _write(p, bytes([value]) * 8)},
                              {"step": step, "value": value})

    write(1, 1)
    write(2, 2)
    write(3, 3)
    root = ckpt.checkpoint_root(run)
    d1, d2, d3 = (ckpt.checkpoint_dir(run, s) for s in (1, 2, 3))
    os.replace(d1, d1 + ".tmp")                        # a save killed after its manifest, before the rename
    os.replace(d2, d2 + ".old")                        # a re-save killed between its renames, its .tmp damaged
    shutil.copytree(d3, d3 + ".old")                   # a re-save killed after its second rename
    os.makedirs(d2 + ".tmp")
    open(os.path.join(d2 + ".tmp", "x.bin"), "wb").close()
    os.makedirs(ckpt.checkpoint_dir(run, 4) + ".tmp")  # a save killed while writing its files
    done = ckpt.recover(run)
    assert sorted(done) == sorted([("promoted", d1), ("removed", d2 + ".tmp"), ("restored", d2),
                                   ("removed", d3 + ".old"), ("removed", ckpt.checkpoint_dir(run, 4) + ".tmp")])
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002", "step_000003"]
    assert [ckpt.read_state(d)["value"] for d in (d1, d2, d3)] == [1, 2, 3]
    assert ckpt.recover(run) == []


def test_prune_counts_only_intact_checkpoints_and_never_removes_the_last_good_one(tmp_path):
    run = str(tmp_path)
    for s in (1, 2, 3):
        ckpt.write_checkpoint(run, s, {"x.bin": lambda p: _write(p, b"abcd")}, {"step": s})
    for s in (2, 3):  # the two newest damaged (a flipped byte, a lost manifest)
        d = ckpt.checkpoint_dir(run, s)
        if s == 2:
            with open(os.path.join(d, "x.bin"), "r+b") as f:
                f.write(b"X")
        else:
            os.remove(os.path.join(d, "manifest.json"))
    assert ckpt.prune(run, keep=1) == []
    assert ckpt.checkpoint_steps(run) == [1, 2, 3] and ckpt.latest_valid(run)[1] == 1
    ckpt.write_checkpoint(run, 4, {"x.bin": lambda p: _write(p, b"abcd")}, {"step": 4})
    assert ckpt.prune(run, keep=1) == [1]           # now one newer intact checkpoint: the older good one goes
    assert ckpt.checkpoint_steps(run) == [2, 3, 4] and ckpt.latest_valid(run)[1] == 4
