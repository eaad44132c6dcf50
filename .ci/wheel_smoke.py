"""Smoke test of an installed wheel, run by .ci/run in a fresh virtual environment from outside the source tree:

    python wheel_smoke.py [--compile] FILE.cu FILE.cuh ...      (the names in the repo's cuda_src/)

The packages must import from site-packages; flame_core.kernels.loader must find, inside the installed package,
exactly the CUDA sources the repo has, every local #include of each .cu must resolve there, and every kernel file the
kernel families name must exist; the prebuilt kernel binaries the manifest lists and the other package data must be
there; `python -m flame_models.train --help` and the
flame-train console script must run (flame-generate must be installed). --compile (on a GPU) compiles every
(file, dtype) module through NVRTC from the installed sources."""
import pathlib
import re
import sys


def main(argv):
    compile_all = "--compile" in argv
    expected = {a for a in argv if a != "--compile"}
    if not expected:
        sys.exit("usage: wheel_smoke.py [--compile] FILE.cu FILE.cuh ... (the repo's cuda_src file names)")

    import flame_core
    import flame_models.flux  # noqa: F401
    import flame_nn  # noqa: F401
    from flame_core.kernels import loader

    pkg = pathlib.Path(flame_core.__file__).resolve().parent
    assert "site-packages" in pkg.parts, f"flame_core imported from {pkg}, not from the installed wheel"
    from flame_core import speedups
    # the C extension: built with the wheel (CI has a C compiler), from the wheel, and in use
    assert speedups.module is not None, "flame_core._speedups is not in the wheel (or does not import)"
    assert pathlib.Path(speedups.module.__file__).resolve().parent == pkg
    assert loader.CUDA_SRC == pkg / "cuda_src", f"the loader reads {loader.CUDA_SRC}, not {pkg / 'cuda_src'}"

    found = {p.name for p in loader.CUDA_SRC.iterdir() if p.suffix in (".cu", ".cuh")}
    assert found == expected, (f"CUDA sources: missing from the wheel {sorted(expected - found)}, "
                               f"not in the repo {sorted(found - expected)}")
    stems = sorted(p.stem for p in loader.CUDA_SRC.glob("*.cu"))
    for stem in stems:
        text = loader.source(stem)  # inlines local headers; a header missing from the wheel is left as an #include
        left = re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, re.M)
        assert not left, f"{stem}.cu: #include {left} not found next to it in {loader.CUDA_SRC}"
        loader.file_arch(stem)
        loader.template_kernels(stem)

    named = set()
    for py in sorted((pkg / "kernels").glob("*.py")):
        named |= set(re.findall(r'(?:get_function|load_module)\(\s*"(\w+)"', py.read_text()))
    missing = sorted(n for n in named if n not in stems)
    assert named and not missing, f"kernel families name sources the wheel lacks: {missing}"
    assert (pkg / "amp" / "README.md").is_file(), "package data flame_core/amp/README.md is missing"
    from flame_core.kernels import prebuilt  # the prebuilt kernel binaries and their manifest (issue 48)
    shipped = [f["path"] for u in prebuilt.manifest().get("units", {}).values() for f in u["files"].values()]
    missing_bin = [p for p in shipped if not (prebuilt.DIR / p).is_file()]
    assert shipped and not missing_bin, f"prebuilt kernel binaries: manifest {prebuilt.MANIFEST}, missing {missing_bin}"

    # the training command and the console scripts (the base install: --help works without the train extra)
    import subprocess
    bindir = pathlib.Path(sys.executable).parent
    for cmd in ([sys.executable, "-m", "flame_models.train", "--help"], [str(bindir / "flame-train"), "--help"]):
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert r.returncode == 0 and "--model" in r.stdout, f"{' '.join(cmd)} failed: {r.stderr[-2000:]}"
    assert (bindir / "flame-generate").is_file(), f"console script flame-generate missing from {bindir}"

    x = flame_core.randn(4, 8, requires_grad=True)
    (x @ x.T).sum().backward()
    assert x.grad.shape == (4, 8)

    msg = f"{len(stems)} .cu and {len(found) - len(stems)} .cuh files at {loader.CUDA_SRC}"
    if compile_all:
        results = loader.precompile()
        errors = [(s, d, e) for s, d, _, e in results if e]
        assert not errors, f"NVRTC failed: {errors}"
        msg += f"; {len(results)} (file, dtype) modules compiled"
    print(f"wheel smoke test passed: {msg}")


if __name__ == "__main__":
    main(sys.argv[1:])
