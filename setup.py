"""What pyproject.toml cannot say: the top-level cuda_src/ folder (the kernels' CUDA C, read and compiled at run
time) ships inside the wheel as package data at flame_core/cuda_src/, where flame_core.kernels.loader looks first;
the prebuilt kernel binaries (flame_core/kernels/binaries/) ship beside the loader. flame_core._speedups (C,
flame_core/csrc: the eager per-op hot paths) is built where a C compiler is found; without one the install goes on
and FLAME uses their Python versions (flame_core/speedups.py).
Everything else about the distribution is in pyproject.toml."""
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        # cuda_src holds CUDA C; its wgmma_gen.py is a developer's generator (it rewrites wgmma.cuh when run)
        return [] if package == "flame_core.cuda_src" else super().find_package_modules(package, package_dir)


setup(
    packages=find_packages(include=["flame_core*", "flame_nn*", "flame_models*"]) + ["flame_core.cuda_src"],
    package_dir={"flame_core.cuda_src": "cuda_src"},
    package_data={"": ["*.md"], "flame_core.cuda_src": ["*.cu", "*.cuh"], "flame_models.tokenization": ["vocab/*"],
                  # the measured conv table (bench/conv_tune.py); the prebuilt kernel binaries (tools/build_kernels.py);
                  # the recorded CuPy compile requests the warm-up replays (flame_core/kernels/cupy_warmup.py)
                  "flame_core.kernels": ["conv_tuned.json", "binaries/manifest.json", "binaries/*/*.fatbin",
                                         "cupy_kernels/*.json.gz"]},
    ext_modules=[Extension("flame_core._speedups",
                           [f"flame_core/csrc/{n}.c"
                            for n in ("module", "recycle", "apply", "pointwise", "tensor", "alloc")],
                           depends=["flame_core/csrc/speedups.h"],
                           libraries=["dl"] if sys.platform.startswith("linux") else [],  # dlopen (libcuda)
                           optional=True)],
    cmdclass={"build_py": BuildPy},
)
