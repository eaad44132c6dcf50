"""On a GPU: kernels from the shipped binaries (flame_core/kernels/binaries/) give bit-identical results to the same
kernels compiled through NVRTC, and loading them compiles nothing. Each side runs tests/kernels/prebuilt_probe.py in
a fresh process with its own empty CuPy cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flame_core.kernels import prebuilt

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _probe(tmp_path, name, prebuilt_on):
    cache, out = tmp_path / f"cache-{name}", tmp_path / f"{name}.npz"
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache), FLAME_PREBUILT_KERNELS="1" if prebuilt_on else "0",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, str(REPO / "tests" / "kernels" / "prebuilt_probe.py"), str(out)], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), dict(np.load(out))


def _device_has_binaries():
    from flame_core.kernels import loader
    m = prebuilt.manifest()
    cc = loader._device_cc()
    return any(prebuilt.arch_for(set(u["files"]), cc) for u in m.get("units", {}).values())


def test_prebuilt_kernels_match_nvrtc_bit_for_bit_and_compile_nothing(tmp_path):
    if not _device_has_binaries():
        pytest.skip("no shipped binary runs on this GPU (NVRTC compiles everything here)")
    pre, pre_out = _probe(tmp_path, "prebuilt", True)
    nv, nv_out = _probe(tmp_path, "nvrtc", False)
    assert pre["compiles"] == [] and pre["stats"]["nvrtc_compiles"] == 0, pre["nvrtc_log"]
    assert pre["stats"]["prebuilt_loads"] > 0
    assert nv["stats"]["prebuilt_loads"] == 0 and nv["stats"]["nvrtc_compiles"] > 0 and nv["compiles"]
    assert sorted(pre_out) == sorted(nv_out) and len(pre_out) == pre["outputs"] > 15
    differ = [k for k in pre_out if not np.array_equal(pre_out[k], nv_out[k])]
    assert not differ, f"prebuilt and NVRTC kernels differ on {differ}"
