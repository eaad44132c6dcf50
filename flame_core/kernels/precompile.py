"""Warming CuPy's disk cache: compile every (file, dtype) module of cuda_src in parallel processes, so that later
`get_function` calls in any process load instead of compiling.

    python3 -m flame_core.kernels.precompile [stem ...]
"""
import re

import numpy as np

from . import loader as L


def _compile_one(stem, dtype_name):
    import time
    t = time.perf_counter()
    try:
        names = L.template_kernels(stem)
        if dtype_name is None or not names:
            L.load_module(stem)
        else:
            L.get_function(stem, names[0], np.dtype(dtype_name) if dtype_name != "bfloat16" else _bf16())
        err = None
    except Exception as e:  # reported, not raised: one broken file must not stop the others
        err = f"{type(e).__name__}: {str(e)[:2000]}"
    return stem, dtype_name, time.perf_counter() - t, err


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


_DTYPES_LINE = re.compile(r"^//\s*dtypes:\s*([\w ,]+)$", re.M)


def _file_dtypes(stem, dtypes):
    """The dtypes a file's templates are instantiated for: a `// dtypes: float16, bfloat16` line limits them."""
    m = _DTYPES_LINE.search(L._read(L.CUDA_SRC / f"{stem}.cu"))
    if m is None:
        return dtypes
    allowed = {d.strip() for d in m.group(1).split(",")}
    return tuple(d for d in dtypes if d in allowed)


def precompile(stems=None, dtypes=("float32", "float16", "bfloat16"), processes=8):
    """Compile every (file, dtype) module in parallel processes so that CuPy's disk cache holds them; later
    `get_function` calls in any process then load instead of compiling. Returns [(stem, dtype, seconds, error)].
    Command line: python3 -m flame_core.kernels.precompile [stem ...]"""
    import concurrent.futures
    import multiprocessing
    stems = stems or sorted(p.stem for p in L.CUDA_SRC.glob("*.cu")
                            if L.file_arch(p.stem) is None or L.arch_available(L.file_arch(p.stem)))
    jobs = [(s, d) for s in stems for d in (_file_dtypes(s, dtypes) if L.template_kernels(s) else (None,))]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        return list(pool.map(_compile_one, *zip(*jobs)))


if __name__ == "__main__":
    import sys

    from flame_core.kernels import precompile as _pre  # workers must unpickle the importable module's function
    for stem_, dt_, sec_, err_ in _pre.precompile(sys.argv[1:] or None):
        print(f"{stem_:24s} {str(dt_):10s} {sec_:6.2f} s  {err_ or 'ok'}", flush=True)
