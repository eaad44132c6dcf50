"""CPU threads: the BLAS is set to one thread at import and spread over the pool (physical cores, FLAME_NUM_THREADS,
set_num_threads) only for large GEMMs; a BLAS the user sized through its own variables is left alone."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import flame_core as flame
from flame_core import threads

REPO = pathlib.Path(__file__).resolve().parents[2]
PROBE = ("import json, threadpoolctl, flame_core as flame, flame_core.threads as T; "
         "print(json.dumps([flame.get_num_threads(), T.physical_cores(), "
         "max(i['num_threads'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas')]))")


def _probe(**env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("FLAME_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True,
                         text=True)
    return out.returncode, out.stdout, out.stderr


def test_import_sets_one_blas_thread_and_a_pool_of_physical_cores():
    rc, out, err = _probe()
    assert rc == 0, err
    pool, cores, blas = json.loads(out)
    assert (pool, blas) == (cores, 1)
    assert 1 <= cores <= (os.cpu_count() or 1)


def test_flame_num_threads_sets_the_pool():
    rc, out, err = _probe(FLAME_NUM_THREADS="3")
    assert rc == 0, err
    assert json.loads(out)[0::2] == [3, 1]
    rc, out, err = _probe(FLAME_NUM_THREADS="0")
    assert rc != 0 and "FLAME_NUM_THREADS must be a positive integer, got '0'" in err


def test_a_blas_sized_by_the_user_is_left_alone():
    rc, out, err = _probe(OPENBLAS_NUM_THREADS="2")
    assert rc == 0, err
    assert json.loads(out)[0::2] == [2, 2]


def test_without_threadpoolctl_the_blas_is_left_alone_with_a_warning():
    base = {k: v for k, v in os.environ.items() if k not in ("FLAME_NUM_THREADS", "OPENBLAS_NUM_THREADS")}

    def run(code, **env):
        hide = "import sys; sys.modules['threadpoolctl'] = None; "  # its import now raises ImportError
        return subprocess.run([sys.executable, "-W", "always", "-c", hide + code], cwd=REPO, env={**base, **env},
                              capture_output=True, text=True)

    out = run("import flame_core as flame; print(flame.get_num_threads())", OPENBLAS_NUM_THREADS="3")
    assert out.returncode == 0 and out.stdout.split() == ["3"] and "threadpoolctl is not installed" in out.stderr
    out = run("import flame_core", FLAME_NUM_THREADS="2")
    assert out.returncode != 0 and "FLAME_NUM_THREADS=2 needs threadpoolctl" in out.stderr


class _FakeBlas:
    def __init__(self):
        self.calls = []

    def set_num_threads(self, n):
        self.calls.append(n)


@pytest.fixture
def fake_blas(monkeypatch):
    fake = _FakeBlas()
    monkeypatch.setattr(threads, "_blas", [fake])
    monkeypatch.setattr(threads, "_num_threads", threads.get_num_threads())
    return fake


def test_only_large_matmuls_use_the_pool(fake_blas, rng):
    flame.set_num_threads(4)
    assert flame.get_num_threads() == 4
    small = flame.tensor(rng.standard_normal((64, 96)), dtype=flame.float32, device="cpu")
    y = small @ small.T
    np.testing.assert_allclose(y.numpy(), small.numpy() @ small.numpy().T, rtol=1e-5, atol=1e-4)
    assert fake_blas.calls == []
    big_a = flame.zeros(8, 256, 256, device="cpu")  # 8·256·256·256 = 2^27 multiply-adds: the threshold
    big_b = flame.zeros(256, 256, device="cpu")
    assert (big_a @ big_b).shape == (8, 256, 256)
    assert fake_blas.calls == [4, 1]  # the pool for this GEMM, then back to one thread
    if flame.cuda_is_available():     # cuBLAS on the GPU: the host BLAS is not touched
        assert (big_a.cuda() @ big_b.cuda()).shape == (8, 256, 256)
        assert fake_blas.calls == [4, 1]
    flame.set_num_threads(1)
    big_a @ big_b
    assert fake_blas.calls == [4, 1]


def test_set_num_threads_takes_positive_integers_only():
    for bad in (0, -2, 1.5, "4", True):
        with pytest.raises(ValueError, match="positive integer"):
            flame.set_num_threads(bad)
