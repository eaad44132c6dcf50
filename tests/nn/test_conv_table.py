"""The measured convolution table (flame_core/kernels/conv_table.py, written by bench/conv_tune.py): its file is
checked with errors naming the file, key and field; 'auto' follows an entry (the algorithm, and the wgmma plan) while
FLAME_CONV_ALGO / FLAME_CONV_WGMMA_TILE set by hand win; the tuner's own output reads back. GPU: an entry decides
which kernel runs and with which plan."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flame_core import backend
from flame_core.kernels import conv as K
from flame_core.kernels import conv_table as T
from flame_core.ops import conv as C

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
G = C.geometry((2, 64, 16, 16), (96, 64, 3, 3), 1, 1, 1, 1)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for k in ("FLAME_CONV_ALGO", "FLAME_CONV_TABLE", "FLAME_CONV_WGMMA_TILE", "FLAME_CONV_WGMMA_DW_TILE"):
        monkeypatch.delenv(k, raising=False)
    T.clear_cache()
    yield
    T.clear_cache()


def _write(path, entries, section="sm90"):
    path.write_text(json.dumps({section: {"device": "test", "entries": entries}}))
    return path


def test_key_names_pass_and_geometry():
    assert T.key("fwd", G) == "fwd 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16"
    g2 = C.geometry((1, 8, 9, 9), (4, 8, 3, 3), 2, 0, 1, 1)
    assert T.key("dx", g2) == "dx 1,8,9,9,4,3,3,2,2,0,0,1,1,4,4"


def test_load_reads_a_section(tmp_path):
    p = _write(tmp_path / "t.json", {T.key("fwd", G): {"algo": "wgmma", "plan": "128x128:s2", "ms": 0.1},
                                     T.key("dx", G): {"algo": "wgmma", "plan": "128x256:t3"},
                                     T.key("dw", G): {"algo": "im2col"}})
    got = T.load(p, "sm90")
    assert got[T.key("fwd", G)]["plan"] == "128x128:s2" and got[T.key("dw", G)]["algo"] == "im2col"
    assert T.load(p, "sm80") == {}                              # another GPU's section: nothing measured
    assert T.load(tmp_path / "missing.json", "sm90") == {}      # no file: an empty table


@pytest.mark.parametrize("entries, match", [
    ({"fwd 1,2,3": {"algo": "wgmma"}}, "15 integers"),
    ({"bwd 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16": {"algo": "wgmma"}}, "must be a pass"),
    ({"fwd 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16": {"algo": "cudnn"}}, "field 'algo'"),
    ({"fwd 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16": {"algo": "wgmma", "plan": "64x64"}}, "field 'plan'"),
    ({"fwd 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16": {"algo": "wgmma", "plan": "128x128:s0"}}, "field 'plan'"),
    ({"fwd 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16": {"algo": "wgmma", "plan": "128x128:t1"}}, "field 'plan'"),
    ({"dw 2,64,16,16,96,3,3,1,1,1,1,1,1,16,16": {"algo": "wgmma", "plan": "128x128:t2"}}, "field 'plan'"),
])
def test_bad_entries_name_the_file_key_and_field(tmp_path, entries, match):
    p = _write(tmp_path / "bad.json", entries)
    with pytest.raises(ValueError, match=match) as e:
        T.load(p, "sm90")
    assert "bad.json" in str(e.value)


def test_bad_json_names_the_file(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        T.load(p, "sm90")


def test_table_switch(monkeypatch, tmp_path):
    assert T.table_path() == T.TABLE_FILE
    monkeypatch.setenv("FLAME_CONV_TABLE", "0")
    assert T.table_path() is None
    monkeypatch.setenv("FLAME_CONV_TABLE", str(tmp_path / "x.json"))
    assert T.table_path() == tmp_path / "x.json"


def test_shipped_table_is_valid():
    """Whatever the tuner last wrote: every section and entry passes the checks."""
    doc = json.loads(T.TABLE_FILE.read_text())
    assert doc and all(sec.get("entries") for sec in doc.values())
    for section in doc:
        assert T.load(T.TABLE_FILE, section)


def test_tuned_follows_the_table_only_under_auto(monkeypatch):
    entry = {"algo": "wgmma", "plan": "128x256:s3"}
    monkeypatch.setattr(T, "lookup", lambda pass_, g: entry if pass_ == "dx" else None)
    assert C.tuned(G, "dx") is entry and C.tuned_plan(G, "dx") == "128x256:s3"
    assert C.tuned(G, "fwd") is None and C.tuned_plan(G, "fwd") is None
    monkeypatch.setenv("FLAME_CONV_ALGO", "dx=wgmma")     # set by hand: the table is not asked
    assert C.tuned(G, "dx") is None
    monkeypatch.setenv("FLAME_CONV_ALGO", "auto")
    entry = {"algo": "im2col"}
    assert C.tuned(G, "dx") is entry and C.tuned_plan(G, "dx") is None


def test_lookup_without_a_gpu_is_none(monkeypatch, tmp_path):
    if backend.cuda_available():
        pytest.skip("a GPU is present")
    _write(tmp_path / "t.json", {T.key("fwd", G): {"algo": "im2col"}})
    monkeypatch.setenv("FLAME_CONV_TABLE", str(tmp_path / "t.json"))
    assert T.lookup("fwd", G) is None


def test_plan_precedence(monkeypatch):
    """The environment beats the table's plan, which beats the waves model."""
    model = K.wgmma_plan(320, 2 * 128 * 128, 45, 132)
    assert model == ("128x256", 45, 1)
    assert K.wgmma_plan(320, 2 * 128 * 128, 45, 132, forced="128x128:s3") == ("128x128", 15, 3)
    monkeypatch.setenv("FLAME_CONV_WGMMA_TILE", "128x256:s2")
    assert K.wgmma_plan(320, 2 * 128 * 128, 45, 132, forced="128x128:s3") == ("128x256", 23, 2)


def test_tuner_smoke_writes_a_table_that_reads_back(tmp_path):
    out = tmp_path / "tuned.json"
    env = dict(os.environ, PYTHONPATH=REPO, OPENBLAS_NUM_THREADS="1", OUT=str(tmp_path))
    r = subprocess.run([sys.executable, "bench/conv_tune.py", "--cpu-smoke", "--shapes", "vae_down_256,sdxl_l0",
                        "--repeats", "2", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = T.load(out, "smoke")
    # both geometries (the downsample with its pad folded in: pad_conv2d's), every pass
    g1 = C.geometry((1, 64, 16, 16), (64, 64, 3, 3), 2, 0, 1, 1, pad_end=(1, 1))   # 1x512x256^2 at 1/8, 1/16
    g2 = C.geometry((1, 32, 8, 8), (32, 32, 3, 3), 1, 1, 1, 1)
    assert {T.key(p, g) for p in C.PASSES for g in (g1, g2)} == set(got)
    for e in got.values():
        assert e["ms"] == min(t for t in e["timed"].values() if isinstance(t, float))
        assert e["im2col_ms"] == e["timed"]["im2col"]


@pytest.mark.gpu
def test_an_entry_decides_the_kernel_and_its_plan(monkeypatch, tmp_path):
    """On an sm_90 GPU: an entry 'im2col' keeps a geometry off the implicit GEMM that the size rule would send there,
    and a wgmma entry's plan reaches wgmma_plan; results match the im2col path."""
    if not K.wgmma_available():
        pytest.skip("needs compute capability 9.0")
    cp = backend.cupy
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((2, 64, 16, 16)).astype(np.float32)).astype(cp.float16)
    w = cp.asarray((rng.standard_normal((96, 64, 3, 3)) * 0.1).astype(np.float32)).astype(cp.float16)
    gy = cp.asarray(rng.standard_normal((2, 96, 16, 16)).astype(np.float32)).astype(cp.float16)
    monkeypatch.setenv("FLAME_CONV_IM2COL_MAX_MB", "0")     # the size rule alone would take the implicit GEMM
    monkeypatch.setenv("FLAME_CONV_TABLE", "0")
    assert C.use_wgmma(x, G, "fwd")
    monkeypatch.setenv("FLAME_CONV_ALGO", "im2col")
    want_y = cp.asnumpy(C.conv2d_forward(x, w, G)).astype(np.float64)
    want_dx, want_dw = (cp.asnumpy(a).astype(np.float64) for a in C.conv2d_backward(gy, x, w, G))
    monkeypatch.delenv("FLAME_CONV_ALGO")
    p = _write(tmp_path / "t.json", {T.key("fwd", G): {"algo": "im2col"},
                                     T.key("dx", G): {"algo": "wgmma", "plan": "128x128:s3"},
                                     T.key("dw", G): {"algo": "wgmma", "plan": "128x256:s5"}},
               section=T.section_name())
    monkeypatch.setenv("FLAME_CONV_TABLE", str(p))
    assert not C.use_igemm(x, G, "fwd") and C.use_wgmma(x, G, "dx") and C.use_wgmma(x, G, "dw")
    seen = []
    orig = K.wgmma_plan

    def spy(*a, **k):
        seen.append(k.get("forced"))
        return orig(*a, **k)
    monkeypatch.setattr(K, "wgmma_plan", spy)
    y = cp.asnumpy(C.conv2d_forward(x, w, G)).astype(np.float64)
    dx, dw = (cp.asnumpy(a).astype(np.float64) for a in C.conv2d_backward(gy, x, w, G))
    assert seen == ["128x128:s3", "128x256:s5"]             # the forward took im2col: no wgmma plan asked
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
