"""What an install carries: the built package holds the CUDA sources (a GPU compiles them at run time) where the
kernel loader looks first. .ci/run checks the real wheel installed in a fresh environment (.ci/wheel_smoke.py)."""
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _loader_dir(cwd, env_extra=None, pythonpath=None):
    env = {"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", "from flame_core.kernels import loader; print(loader.CUDA_SRC)"],
                         cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return pathlib.Path(out.stdout.strip())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The package tree setuptools builds (build_py: what a wheel holds), outside the repo."""
    tmp = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, str(REPO / "setup.py"), "-q", "egg_info", "--egg-base", str(tmp), "build_py",
                    "--build-lib", str(tmp / "lib")], cwd=REPO, check=True, capture_output=True)
    return tmp / "lib"


def test_the_built_package_carries_every_cuda_source(built):
    want = sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh"))
    have = sorted(p.name for p in (built / "flame_core" / "cuda_src").iterdir())
    assert want and have == want  # the generator script wgmma_gen.py stays out (it rewrites wgmma.cuh when run)
    assert (built / "flame_core" / "amp" / "README.md").is_file()
    # the measured convolution table F.conv2d follows on a GPU (flame_core/kernels/conv_table.py)
    assert (built / "flame_core" / "kernels" / "conv_tuned.json").read_bytes() == \
        (REPO / "flame_core" / "kernels" / "conv_tuned.json").read_bytes()


def test_the_built_package_carries_the_prebuilt_kernel_binaries(built):
    """Every binary the manifest names, byte for byte (the loader uses them instead of compiling: issue 48)."""
    import json
    src, dst = REPO / "flame_core" / "kernels" / "binaries", built / "flame_core" / "kernels" / "binaries"
    m = json.loads((src / "manifest.json").read_text())
    assert (dst / "manifest.json").read_bytes() == (src / "manifest.json").read_bytes()
    paths = sorted(f["path"] for u in m["units"].values() for f in u["files"].values())
    assert paths and sorted(str(p.relative_to(dst)) for p in dst.glob("*/*.fatbin")) == paths
    assert all((dst / p).read_bytes() == (src / p).read_bytes() for p in paths)


def test_the_loader_reads_the_installed_copy_first_then_the_repo_then_the_override(built, tmp_path):
    assert _loader_dir(tmp_path, pythonpath=built) == built / "flame_core" / "cuda_src"
    assert _loader_dir(REPO) == REPO / "cuda_src"
    assert _loader_dir(REPO, {"FLAME_CUDA_SRC": str(tmp_path)}) == tmp_path


def test_the_distribution_name_is_not_an_unrelated_pypi_project():
    name = re.search(r'^name = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert name == "flame-diffusion"  # "flame" and "flame-core" are other projects on PyPI


def test_the_training_command_runs_from_the_built_package_and_both_console_scripts_resolve(built, tmp_path):
    """`python -m flame_models.train --help` from the package as installed (outside the repo), and the console
    scripts pyproject.toml declares (flame-train, flame-generate) name importable mains. .ci/wheel_smoke.py runs
    both scripts from the real wheel."""
    env = {"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(built)}
    r = subprocess.run([sys.executable, "-m", "flame_models.train", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m flame_models.train") and "--allow-upscale" in r.stdout
    import configparser
    entry_points = configparser.ConfigParser()
    entry_points.read(built.parent / "flame_diffusion.egg-info" / "entry_points.txt")
    scripts = dict(entry_points["console_scripts"])
    assert scripts == {"flame-train": "flame_models.train:main", "flame-generate": "flame_models.generate:main"}
    code = "; ".join(f"import {v.split(':')[0]} as m; assert callable(m.main) and m.__file__.startswith("
                     f"{str(built)!r})" for v in scripts.values())
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=120)
