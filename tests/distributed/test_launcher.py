"""The launcher: every child gets its environment, output is prefixed by rank, a failing rank stops the others and
its exit code becomes the job's, signals reach every child once."""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "distributed", "scripts", "child.py")


def launch(*args, wait=True, env_extra=None, **kw):
    cmd = [sys.executable, "-m", "flame_core.distributed.run", *args]
    env = {**os.environ, "PYTHONPATH": ROOT, **(env_extra or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60, **kw)


def test_each_child_gets_its_environment_and_its_output_is_prefixed(tmp_path):
    r = launch("--nproc-per-node", "3", CHILD, "env", str(tmp_path))
    assert r.returncode == 0, r.stderr.decode()
    envs = [json.load(open(tmp_path / f"rank{k}.json")) for k in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"localhost"} and {e["NODE_RANK"] for e in envs} == {"0"}
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {os.environ.get("CUDA_VISIBLE_DEVICES")}  # untouched
    secrets = {e["FLAME_STORE_SECRET"] for e in envs}  # one fresh secret per run, the same for its ranks
    assert len(secrets) == 1 and len(secrets.pop()) == 64
    out, err = r.stdout.decode().splitlines(), r.stderr.decode().splitlines()
    assert sorted(out) == [f"[rank{k}]: out of {k}" for k in range(3)]
    assert sorted(err) == [f"[rank{k}]: err of {k}" for k in range(3)]


def test_second_node_of_two_gets_global_ranks_and_the_given_rendezvous(tmp_path):
    args = ("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7",
            "--master-port", "29555", CHILD, "env", str(tmp_path))
    r = launch(*args, env_extra={"FLAME_STORE_SECRET": ""})
    assert r.returncode == 2 and b"--nnodes > 1 needs FLAME_STORE_SECRET set" in r.stderr
    assert not os.listdir(tmp_path)  # refused before any rank started
    r = launch(*args, env_extra={"FLAME_STORE_SECRET": "short"})
    assert r.returncode == 2 and b"FLAME_STORE_SECRET has 5 characters" in r.stderr
    r = launch(*args, env_extra={"FLAME_STORE_SECRET": "the-same-secret-on-every-node"})
    assert r.returncode == 0, r.stderr.decode()
    envs = {k: json.load(open(tmp_path / f"rank{k}.json")) for k in (2, 3)}
    assert {e["FLAME_STORE_SECRET"] for e in envs.values()} == {"the-same-secret-on-every-node"}
    assert [envs[k]["LOCAL_RANK"] for k in (2, 3)] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"4"} and {e["NODE_RANK"] for e in envs.values()} == {"1"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()} == {("10.0.0.7", "29555")}


def test_a_failing_rank_stops_the_others_and_its_code_is_the_jobs(tmp_path):
    t = time.monotonic()
    r = launch("--nproc-per-node", "3", CHILD, "fail", str(tmp_path), "1", "7")
    assert r.returncode == 7
    assert time.monotonic() - t < 30  # the others' 60 s sleeps were cut short
    assert "rank 1 exited with code 7; stopping the other ranks" in r.stderr.decode()
    assert sorted(os.listdir(tmp_path)) == ["rank0.started", "rank2.started"]  # none finished


def test_a_rank_killed_by_a_signal_reports_128_plus_it(tmp_path):
    r = launch("--nproc-per-node", "2", CHILD, "killed", str(tmp_path), "0", "0")
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 0 exited with code 137" in r.stderr.decode()


def test_ranks_that_ignore_sigterm_are_killed_after_the_kill_timeout(tmp_path):
    t = time.monotonic()
    r = launch("--nproc-per-node", "3", "--kill-timeout", "0.5", CHILD, "stubborn", str(tmp_path))
    assert r.returncode == 3 and time.monotonic() - t < 30
    assert not [f for f in os.listdir(tmp_path) if f.endswith("finished")]


def test_sigterm_to_the_launcher_reaches_every_child_once(tmp_path):
    p = launch("--nproc-per-node", "2", CHILD, "signal", str(tmp_path), wait=False)
    deadline = time.monotonic() + 30
    while len([f for f in os.listdir(tmp_path) if f.endswith(".ready")]) < 2:
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err.decode()
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith("sigterm")) == ["rank0.sigterm", "rank1.sigterm"]


def test_bad_arguments_are_refused():
    r = launch("--nproc-per-node", "0", CHILD)
    assert r.returncode == 2 and b"--nproc-per-node >= 1" in r.stderr
    r = launch("--nnodes", "2", CHILD)
    assert r.returncode == 2 and b"--master-addr is required" in r.stderr
    r = launch("no/such/script.py")
    assert r.returncode == 2 and b"no such script" in r.stderr


def test_a_module_target():
    r = launch("--nproc-per-node", "2", "-m", "json.tool", "--help")
    assert r.returncode == 0 and r.stdout.decode().count("[rank1]: usage") == 1


def test_hang_dump_prints_every_ranks_stack(tmp_path):
    """FLAME_DIST_HANG_DUMP=S: a rank still running S seconds after joining prints where each thread is."""
    script = tmp_path / "stuck.py"
    script.write_text("import time\nimport flame_core.distributed as dist\ndist.init_process_group('store')\n"
                      "def waiting_here():\n    time.sleep(2.5)\nwaiting_here()\ndist.destroy_process_group()\n")
    r = launch("--nproc-per-node", "2", str(script), env_extra={"FLAME_DIST_HANG_DUMP": "1"})
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    for k in range(2):
        assert f"[rank{k}]: " in err and "waiting_here" in err, err[-2000:]
    assert "Timeout (0:00:01)!" in err, err[-2000:]


def test_a_bad_hang_dump_value_is_refused(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import flame_core.distributed as dist\ndist.init_process_group('store')\n")
    r = launch("--nproc-per-node", "1", str(script), env_extra={"FLAME_DIST_HANG_DUMP": "soon"})
    assert r.returncode != 0 and "FLAME_DIST_HANG_DUMP must be a number of seconds" in r.stderr.decode()
