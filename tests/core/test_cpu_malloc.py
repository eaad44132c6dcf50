"""glibc's malloc thresholds set at import (flame_core/cpu_malloc.py): a training step's freed arrays are reused by the
next one instead of being unmapped and faulted in again page by page."""
import os
import subprocess
import sys

import pytest

from flame_core import cpu_malloc

glibc = pytest.mark.skipif(not cpu_malloc._glibc(), reason="the thresholds are glibc's")

# six arrays of 1-7 MiB made (written) and freed 30 times: the page faults after the first round
_PROBE = """
import resource, numpy as np, flame_core
sizes = [(1 << 18) * k for k in (1, 3, 5, 2, 7, 4)]
[np.ones(n, np.float32) for n in sizes]
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    arrs = [np.ones(n, np.float32) for n in sizes]
    del arrs
print(flame_core.cpu_malloc.applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _probe(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("FLAME_CPU_MALLOC", *cpu_malloc._USER_VARS)}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@glibc
def test_freed_arrays_are_reused_without_page_faults():
    applied, faults = _probe()
    off, faults_off = _probe(FLAME_CPU_MALLOC="0")
    assert applied and not off
    # 29 rounds x 22 MiB: ~160 thousand 4 KiB pages when each block is unmapped on free and mapped again
    assert faults_off > 20000, faults_off
    assert faults < faults_off / 10, (faults, faults_off)


@glibc
@pytest.mark.parametrize("env", [{"FLAME_CPU_MALLOC": "0"}, {"MALLOC_TRIM_THRESHOLD_": "1048576"},
                                 {"MALLOC_MMAP_THRESHOLD_": "1048576"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}])
def test_left_alone_when_opted_out_or_set_by_the_user(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cpu_malloc.tune() is False

