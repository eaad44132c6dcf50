"""bench/conv.py --cpu-smoke: every shape kind (3x3 stride 1 and 2, the asymmetric VAE pad, a 1x1 skip conv) and an
SDXL ResBlock with a skip conv run scaled down on the cpu, so the GPU call that measures them does not fail on the
script (torch, where installed, is compared too)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_conv_bench_runs_every_kind_of_shape_on_the_cpu(tmp_path):
    shapes = "sdxl_l0,sdxl_down_64,sdxl_skip_960_320,vae_down_256"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "conv.py"), "--cpu-smoke", "--repeats", "2",
                        "--shapes", shapes, "--resblocks", "sdxl_rb_640_1280"], cwd=tmp_path, capture_output=True,
                       env={**os.environ, "OUT": str(tmp_path), "OPENBLAS_NUM_THREADS": "1",
                            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)},
                       timeout=300)
    assert r.returncode == 0, (r.stdout.decode()[-3000:], r.stderr.decode()[-3000:])
    res = json.load(open(tmp_path / "conv.json"))["results"]
    assert set(res) == set(shapes.split(",")) | {"sdxl_rb_640_1280"}
    assert res["vae_down_256"]["pad"] == [0, 1, 0, 1] and res["vae_down_256"]["stride"] == 2
    assert res["sdxl_skip_960_320"]["flame"]["paths"]["fwd"] == "cublas 1x1"
    for name in shapes.split(","):
        f = res[name]["flame"]
        assert all(f[k] > 0 for k in ("fwd_ms", "fwdbwd_ms", "dx_ms", "dw_ms")), (name, f)
        if "max_rel_diff_vs_torch" in res[name]:
            assert res[name]["max_rel_diff_vs_torch"] < 1e-4, name
    rb = res["sdxl_rb_640_1280"]
    assert rb["flame_fwdbwd_frozen_ms"] > 0 and rb["flame_fwdbwd_trained_ms"] > 0
    if "max_rel_diff_vs_torch" in rb:   # diffusers' ResnetBlock2D with the same weights
        assert rb["max_rel_diff_vs_torch"] < 1e-4
