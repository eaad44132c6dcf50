"""Run by test_prebuilt_gpu.py in a fresh process (fresh CUPY_CACHE_DIR): a fixed set of kernel-family calls on fixed
inputs, on the GPU; writes their outputs (bit patterns) to OUT.npz and prints one JSON line: the loader's counts,
and how many NVRTC compiles of FLAME's kernels happened (counted at CuPy's entry points, independently of the
loader's own counts).

    python tests/kernels/prebuilt_probe.py OUT.npz
"""
import json
import sys

import numpy as np

compiles = []


def _count_compiles(cp):
    """Wrap cupy.RawModule (code= compiles through NVRTC; path= loads a binary) and the compile CuPy's arch path uses
    (loader._ArchModule) so that every NVRTC compile of a FLAME kernel is seen."""
    raw = cp.RawModule

    def raw_module(*args, **kw):
        if kw.get("code") is not None:
            compiles.append("RawModule(code=...)")
        return raw(*args, **kw)
    cp.RawModule = raw_module
    from cupy._core import core
    cwc = core.compile_with_cache

    def compile_with_cache(source, *args, **kw):
        if '#line 1 "' in source:  # a FLAME source (the loader's expansion), not one of CuPy's own kernels
            compiles.append("compile_with_cache")
        return cwc(source, *args, **kw)
    core.compile_with_cache = compile_with_cache


def main(out):
    import cupy as cp
    import ml_dtypes
    _count_compiles(cp)
    from flame_core.kernels import activations, attention, groupnorm, loader, norms, rope, softmax
    rng = np.random.default_rng(0)
    results = {}

    def arr(shape, dtype):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    def keep(name, *arrays):
        for i, a in enumerate(arrays):
            if a is not None:
                h = cp.asnumpy(a)
                results[f"{name}.{i}"] = h.view(np.uint16) if h.dtype.itemsize == 2 else h.view(np.uint32) \
                    if h.dtype.itemsize == 4 else h

    for dt in (np.float32, ml_dtypes.bfloat16):  # (the NVRTC side compiles each module: kept to what proves the point)
        n = np.dtype(dt).name
        x, w, b, dy = arr((64, 320), dt), arr((320,), np.float32), arr((320,), np.float32), arr((64, 320), dt)
        y, mean, rstd = norms.layer_norm_forward(x, w, b)
        keep(f"ln_fwd.{n}", y, mean, rstd)
        keep(f"ln_bwd.{n}", *norms.layer_norm_backward(dy, x, w, mean, rstd, b))
        keep(f"softmax.{n}", softmax.softmax_forward(x))
        keep(f"gelu.{n}", activations.gelu_forward(x), activations.gelu_backward(dy, x, "tanh"))
        keep(f"silu.{n}", activations.silu_forward(x), activations.silu_backward(dy, x))
        xg = arr((2, 64, 8, 8), dt)
        keep(f"groupnorm.{n}", *groupnorm.group_norm_forward(xg, 32, w[:64], b[:64]))
    for dt in (ml_dtypes.bfloat16,):
        n = np.dtype(dt).name
        q, k, v = (arr((1, 2, 256, 64), dt) for _ in range(3))
        o, lse = attention.flash_attention_forward(q, k, v, is_causal=True)
        keep(f"attn_fwd.{n}", o, lse)
        keep(f"attn_bwd.{n}", *attention.flash_attention_backward(arr((1, 2, 256, 64), dt), q, k, v, o, lse,
                                                                 is_causal=True))
        xr, freqs = arr((1, 2, 16, 64), dt), arr((16, 32, 2, 2), np.float32)
        keep(f"rope.{n}", rope.rope_forward(xr, freqs))
    cp.cuda.runtime.deviceSynchronize()
    np.savez(out, **results)
    print(json.dumps({"nvrtc_version": list(cp.cuda.nvrtc.getVersion()), "stats": loader.stats,
                      "nvrtc_log": [[s, list(e)] for s, e in loader.nvrtc_log],
                      "compiles": compiles, "outputs": len(results)}))


if __name__ == "__main__":
    main(sys.argv[1])
