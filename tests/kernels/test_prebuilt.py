"""The prebuilt kernel binaries (flame_core/kernels/prebuilt.py, tools/build_kernels.py): the build covers every unit
the loader can ask for, the shipped binaries match the sources (a stale one is never used), keys follow the sources,
and the loader picks the binary that runs on the device. The GPU half (identical results, no NVRTC compile) is
test_prebuilt_gpu.py."""
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from flame_core.kernels import loader, prebuilt, precompile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_kernels", REPO / "tools" / "build_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernel_stems_named_in_code():
    named = set()
    for py in sorted((REPO / "flame_core").rglob("*.py")) + sorted((REPO / "flame_nn").rglob("*.py")):
        named |= set(re.findall(r'(?:get_function|load_module)\(\s*"(\w+)"', py.read_text()))
    return named


def test_the_build_covers_every_module_the_loader_compiles(build):
    units = {(s, d): [e for e, _ in ex] for s, d, ex in build.units()}
    stems = sorted(p.stem for p in loader.CUDA_SRC.glob("*.cu"))
    assert {s for s, _ in units} == set(stems)
    assert _kernel_stems_named_in_code() <= set(stems)
    for stem in stems:
        names = loader.template_kernels(stem)
        for d in (precompile._file_dtypes(stem, build.DTYPES) if names else ()):
            # the per-(file, dtype) module get_function compiles: every single-parameter template of the file
            t = loader._CTYPES[d]
            assert set(f"{n}<{t}>" for n in names) <= set(units[stem, d]), (stem, d)
    # kernels asked for by name expression only: the families' default instantiations are there
    assert "silu_fwd<__half, 1>" in units["activations", "float16"]
    assert any(e.startswith("flash_attn_fwd<__nv_bfloat16, 128,") for e in units["flash_attention_fwd", "bfloat16"])
    assert "tanh_bwd<float>" in units["pointwise_grad", "float32"]  # a macro-declared template


def test_every_sm90_forward_schedule_is_prebuilt(build):
    """The Hopper forward's instantiations for each default tile, mask kind and schedule switch (the default -- the
    intra-warpgroup overlap where SM90_FWD_OVERLAP is on --, ping-pong) are in the build, under the expression the
    launch forms: flipping the ping-pong switch loads a binary instead of compiling through NVRTC."""
    from flame_core.kernels import attention as AT
    units = {(s, d): {e for e, _ in ex} for s, d, ex in build.units()}
    ov = int(AT.SM90_FWD_OVERLAP)
    for d, t in (("float16", "__half"), ("bfloat16", "__nv_bfloat16")):
        for D, (BN, NWG, ST) in AT.FWD_SM90_TILES.items():
            for kind in (0, 1, 2, AT.MASK_KEYPAD):
                for pp in (0, 1):
                    for tma in (True, False):
                        expr = AT.sm90_fwd_expression(D, BN, NWG, ST, kind, pp, tma, ov).replace("{T}", t)
                        assert expr in units["flash_attention_fwd_sm90", d], expr


def test_the_shipped_binaries_match_the_sources(build):
    """Rebuild with `python tools/build_kernels.py` (nvcc) after editing cuda_src; the loader would otherwise compile
    the edited files through NVRTC (correct, but the cold start pays for it)."""
    assert prebuilt.MANIFEST.is_file(), "flame_core/kernels/binaries/manifest.json missing: run tools/build_kernels.py"
    problems = build.check()
    assert not problems, "\n".join(problems[:20])
    m = json.loads(prebuilt.MANIFEST.read_text())
    archs = {a for u in m["units"].values() for a in u["files"]}
    assert {"sm_80", "sm_90", "sm_90a", "sm_100", "sm_120", "compute_120"} <= archs
    for name, u in m["units"].items():  # the single-parameter templates are in every arch's binary
        for arch, f in u["files"].items():
            want = [e for e, sm in u["expressions"] if int(arch.split("_")[1].rstrip("a")) >= sm]
            assert sorted(f["names"]) == sorted(want), (name, arch)
            assert all(v.startswith("_Z") for v in f["names"].values())


def test_keys_follow_the_sources_and_headers_only(tmp_path, monkeypatch):
    src = tmp_path / "cuda_src"
    shutil.copytree(loader.CUDA_SRC, src)
    monkeypatch.setattr(loader, "CUDA_SRC", src)
    monkeypatch.setattr(loader, "_sources", {})
    opts = loader.NVRTC_OPTIONS + prebuilt.EXTRA_OPTIONS

    def key(stem):
        loader._sources.clear()
        return prebuilt.key(loader.source(stem), opts)

    before = {s: key(s) for s in ("norms", "rope", "im2col")}
    assert prebuilt.key(loader.source("norms"), opts) != prebuilt.key(loader.source("norms"), ("--std=c++14",))
    with open(src / "common.cuh", "a") as f:  # a header norms.cu and rope.cu include
        f.write("\n// edited\n")
    after = {s: key(s) for s in before}
    assert after["norms"] != before["norms"]
    assert after["rope"] != before["rope"]
    assert after["im2col"] == before["im2col"]  # does not include common.cuh
    with open(src / "im2col.cu", "a") as f:
        f.write("\n")
    assert key("im2col") != before["im2col"]


def _fake_manifest(monkeypatch, units):
    monkeypatch.setattr(prebuilt, "_manifest", [{"format": prebuilt.FORMAT, "units": units}])
    monkeypatch.setattr(loader, "_prebuilt_by_stem", {})
    monkeypatch.setattr(loader, "_stem_keys", {})


def _unit(stem, files, key=None):
    opts = loader.NVRTC_OPTIONS + prebuilt.EXTRA_OPTIONS
    return {"stem": stem, "key": key or prebuilt.key(loader.source(stem), opts), "files": files}


def test_the_loader_picks_the_binary_for_the_device_and_never_a_stale_one(monkeypatch):
    names = {"rope_apply<float>": "_Z10rope_applyIfEvPKT_PKfPS0_xiiiii"}
    f80 = {"path": "sm_80/rope.float32.fatbin", "names": names, "c_names": []}
    f90 = {"path": "sm_90/rope.float32.fatbin", "names": names, "c_names": []}
    _fake_manifest(monkeypatch, {"rope:float32": _unit("rope", {"sm_80": f80, "sm_90": f90})})
    exprs = ("rope_apply<float>",)
    assert loader._prebuilt_choice("rope", exprs, "90")[1:] == ("sm_90", f90)
    assert loader._prebuilt_choice("rope", exprs, "86")[1:] == ("sm_80", f80)  # sm_80 code runs on 8.6 and 8.9
    assert loader._prebuilt_choice("rope", exprs, "89")[1] == "sm_80"
    assert loader._prebuilt_choice("rope", exprs, "100") is None  # no binary runs there: NVRTC
    assert loader._prebuilt_choice("rope", exprs, "75") is None
    assert loader._prebuilt_choice("rope", ("rope_apply<__half>",), "90") is None  # not in the binary
    _fake_manifest(monkeypatch, {"rope:float32": _unit("rope", {"sm_90": f90}, key="0" * 64)})
    assert loader._prebuilt_choice("rope", exprs, "90") is None  # stale: the sources changed since the build


def test_an_exact_arch_binary_runs_on_its_own_device_only(monkeypatch):
    f = {"path": "sm_90a/conv_wgmma.float16.fatbin", "names": {"k<__half, 1>": "_Z1kI6__halfLi1EEvv"}, "c_names": []}
    _fake_manifest(monkeypatch, {"conv_wgmma:float16": _unit("conv_wgmma", {"sm_90a": f})})
    assert loader._prebuilt_choice("conv_wgmma", ("k<__half, 1>",), "90")[1] == "sm_90a"
    assert loader._prebuilt_choice("conv_wgmma", ("k<__half, 1>",), "100") is None
    assert prebuilt.arch_for({"sm_90a", "sm_90"}, "90") == "sm_90"
    assert prebuilt.arch_for({"sm_80", "sm_86"}, "89") == "sm_86"
    assert prebuilt.arch_for({"sm_120"}, "121") == "sm_120"
    assert prebuilt.arch_for({"sm_90", "sm_120", "compute_120"}, "130") == "compute_120"  # PTX: the driver compiles
    assert prebuilt.arch_for({"sm_90", "compute_120"}, "120") == "compute_120"
    assert prebuilt.arch_for({"sm_90", "compute_120"}, "100") is None
    assert prebuilt.arch_for({"compute_120"}, "90", exact="sm_90a") is None


def test_the_switch_and_a_damaged_manifest_turn_the_binaries_off(monkeypatch, tmp_path):
    monkeypatch.setattr(prebuilt, "_manifest", [])
    monkeypatch.setenv("FLAME_PREBUILT_KERNELS", "0")
    assert prebuilt.manifest() == {}
    monkeypatch.delenv("FLAME_PREBUILT_KERNELS")
    bad = tmp_path / "manifest.json"
    bad.write_text("{not json")
    monkeypatch.setattr(prebuilt, "MANIFEST", bad)
    assert prebuilt.manifest() == {}


@pytest.mark.parametrize("demangled, expr", [
    ("void norm_bwd_cl<float, 2, 1, 2, true, 80>(float const*, int)", "norm_bwd_cl<float, 2, 1, 2, 1, 80>"),
    ("void conv_fwd_wgmma<__half, 256, 4, 0, 1, true>(__half const*)", "conv_fwd_wgmma<__half, 256, 4, 0, 1, true>"),
    ("void k<__nv_bfloat16, (Mode)2, 3u>(int)", "k<__nv_bfloat16, 2, 3>"),
])
def test_lowered_names_match_their_expressions(build, demangled, expr):
    assert build._template_args(demangled) == build._template_args(expr)
    assert build._template_args("void k<float, 2>(int)") != build._template_args("k<float, 3>")
