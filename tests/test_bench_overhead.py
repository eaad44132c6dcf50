"""bench/overhead.py on the CPU: the interleaved rounds and, with --split, the forward / backward rounds after them
(their own per-round ratios; the whole-chain figure does not include them). A stand-in peer (FLAME itself under
torch's names) gives ratios where torch is not installed."""
import os
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import overhead  # noqa: E402

import flame_core as flame  # noqa: E402
import flame_nn.functional as F  # noqa: E402

PEER = types.SimpleNamespace(manual_seed=flame.manual_seed, randn=flame.randn,
                             nn=types.SimpleNamespace(functional=types.SimpleNamespace(linear=F.linear)))


def test_split_rounds_time_both_halves_of_both_sides():
    row = overhead.interleaved("cpu", PEER, rounds=3, chains=2, warmup=1, split=True)
    assert len(row["flame_rounds"]) == len(row["torch_rounds"]) == 3
    sp = row["split"]
    for k in ("flame_forward", "flame_backward", "torch_forward", "torch_backward", "forward_ratio",
              "backward_ratio"):
        assert sp[k] > 0, k
    # the halves of one chain add up to about a whole chain (the same code on both sides here)
    assert 0.3 < (sp["flame_forward"] + sp["flame_backward"]) / row["flame_us_per_op"] < 3
    assert "split" not in overhead.interleaved("cpu", None, rounds=1, chains=1, warmup=1)


def test_the_linear_chain_trains_every_layer():
    """--chain linear: 100 x (linear, tanh) on both sides; each trial resets and then fills every weight's and bias's
    gradient (the chain's backward reaches them all)."""
    row = overhead.interleaved("cpu", PEER, rounds=2, chains=1, warmup=1, kind="linear")
    assert row["chain"] == "linear" and len(row["flame_rounds"]) == len(row["torch_rounds"]) == 2
    assert all(v > 0 for v in row["flame_rounds"] + row["torch_rounds"])
    name, x, sync, run, params = overhead._flame_side("cpu", "linear")
    assert len(params) == 1 + 2 * (overhead.N_OPS // 2)
    run(x).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)


def test_the_command_prints_the_split_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "overhead.py"), "--device", "cpu", "--rounds", "2",
                        "--chains", "1", "--split", "--no-torch"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "forward and backward timed apart" in r.stdout and "FLAME bwd" in r.stdout


def test_the_profile_names_the_engine_and_the_ops(tmp_path):
    """--profile N: per device, cProfile of N chains (forward and backward apart) as per-op figures, and the packed
    kernel launches per chain (none on the CPU); the report is printed and written under $OUT."""
    prof = overhead.profile("cpu", "elementwise", 2, top=40)
    assert prof["launches_per_chain"] == {"forward": 0.0, "backward": 0.0}
    text = prof["report"]
    assert "### forward, 2 chains" in text and "### backward, 2 chains" in text
    # Function.apply runs function.py's while profiled (cProfile loses the frames around the C one)
    assert "engine.py" in text and "run_backward" in text and "function.py" in text and "(apply)" in text
    env = {**os.environ, "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "overhead.py"), "--device", "cpu", "--rounds", "1",
                        "--chains", "1", "--no-torch", "--profile", "2"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    saved = (tmp_path / "overhead_elementwise_profile.txt").read_text()
    assert "packed kernel launches per chain" in saved and "run_backward" in r.stdout
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "overhead.py"), "--profile", "-1"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--profile: a number of chains" in bad.stderr
