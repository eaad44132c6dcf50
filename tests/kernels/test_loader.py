"""The kernel loader: source expansion with #line mapping, template discovery, switches, errors, launch sizes."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flame_core import backend
from flame_core.errors import DTypeError, KernelCompileError
from flame_core.kernels import launching, loader, plans


def test_includes_are_inlined_with_line_directives():
    src = loader.source("norms")
    raw = (loader.CUDA_SRC / "norms.cu").read_text().splitlines()
    inc_line = next(i + 1 for i, line in enumerate(raw) if line.strip() == '#include "common.cuh"')
    assert src.startswith('#line 1 "norms.cu"\n')
    assert '#line 1 "common.cuh"\n' in src
    assert f'#line {inc_line + 1} "norms.cu"\n' in src
    assert '#include "common.cuh"' not in src
    # the text after the directive is the original file from the line after the include
    after = src.split(f'#line {inc_line + 1} "norms.cu"\n', 1)[1]
    assert after.splitlines()[:3] == raw[inc_line:inc_line + 3]


def test_each_header_is_inlined_once():
    src = loader.source("fp8")  # includes common.cuh (which includes system headers only)
    assert src.count('#line 1 "common.cuh"') == 1
    assert "#include <cuda_fp8.h>" in src  # system headers stay for NVRTC


def test_every_local_include_is_inlined_even_with_a_trailing_comment():
    # NVRTC gets one string: a local include left in it cannot be opened (conv_igemm.cu's include of common.cuh
    # carries a comment)
    for f in sorted(loader.CUDA_SRC.glob("*.cu")):
        src = loader.source(f.stem)
        left = [ln for ln in src.splitlines() if re.match(r'\s*#\s*include\s+"', ln)]
        assert not left, (f.name, left)
    assert '#line 1 "common.cuh"' in loader.source("conv_igemm")


def test_template_kernels_found_per_file():
    assert loader.template_kernels("softmax") == [f"softmax_{d}{v}" for d in ("fwd", "bwd") for v in plans.VPTS]
    assert loader.template_kernels("gelu_rows") != []
    assert loader.template_kernels("activations") == []  # <T, U> templates: asked for by name expression
    assert "bcast_bwd" in loader.template_kernels("modulate")  # declared with __launch_bounds__


def test_ctype_mapping():
    import ml_dtypes
    assert loader.ctype(np.float32) == "float"
    assert loader.ctype(np.float16) == "__half"
    assert loader.ctype(ml_dtypes.bfloat16) == "__nv_bfloat16"
    with pytest.raises(DTypeError, match="int32"):
        loader.ctype(np.int32)


def test_switches(monkeypatch):
    monkeypatch.setenv("FLAME_KERNELS", "1")
    gpu = backend.cuda_available()
    assert loader.enabled() == gpu
    with loader.reference():
        assert not loader.enabled()
        with loader.reference():
            assert not loader.enabled()
        assert not loader.enabled()
    assert loader.enabled() == gpu
    monkeypatch.setenv("FLAME_KERNELS", "0")  # read at every call
    assert not loader.enabled()


def test_use_kernel_needs_cuda_arrays_of_kernel_dtypes():
    assert not loader.use_kernel(np.zeros(4, np.float32))


def test_compile_error_names_file_and_line():
    log = ('norms.cu(41): error: identifier "bogus" is undefined\n'
           'common.cuh(12): error: expected a ";"\n2 errors detected')
    err = loader._compile_error("norms", RuntimeError(log))
    assert isinstance(err, KernelCompileError)
    assert "cuda_src/norms.cu" in str(err) and "first error at cuda_src/norms.cu:41" in str(err)
    assert 'identifier "bogus"' in str(err)


def test_missing_source_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "CUDA_SRC", tmp_path)
    monkeypatch.setattr(loader, "_sources", {})
    with pytest.raises(KernelCompileError, match="nope.cu not found"):
        loader.source("nope")


@settings(max_examples=200)
@given(nvec=st.one_of(st.sampled_from([1, 3, 32, 33, 100, 256, 257, 1024, 4097]), st.integers(1, 20000)),
       vpt=st.sampled_from([1, 2, 4]))
def test_row_tpr_covers_the_row(nvec, vpt):
    tpr = plans.row_tpr(nvec, vpt)
    assert tpr * vpt >= nvec                                   # every vector cached by some thread
    if tpr <= 32:
        assert tpr & (tpr - 1) == 0 and (tpr == 1 or (tpr // 2) * vpt < nvec)  # shuffle group, the smallest
    else:
        assert tpr % 32 == 0 and (tpr - 32) * vpt < nvec      # whole warps, the fewest


class _FakeKernel:
    def __init__(self, max_threads):
        self.max_threads_per_block = max_threads


@settings(max_examples=200)
@given(cols=st.one_of(st.sampled_from([1, 7, 64, 128, 1000, 3072, 12288, 16384, 16385, 100000]),
                      st.integers(1, 200000)), vec=st.sampled_from([1, 4, 8]), max_threads=st.sampled_from([1024, 512]))
def test_row_plan_covers_rows_and_respects_register_limits(cols, vec, max_threads):
    asked = []

    def fake_get_function(stem, name, dtype=None):
        asked.append(name)
        return _FakeKernel(max_threads)
    v = vec if cols % vec == 0 else 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "get_function", fake_get_function)
        kernel, grid, block, tpr = plans.row_plan("norms", "norm_fwd", np.float32, 1000, cols, v)
    vpt = int(asked[-1][-1])
    assert asked[-1] == f"norm_fwd{vpt}" and vpt in plans.VPTS
    assert block[0] == (tpr if tpr > 32 else 128) and tpr <= max_threads
    rows_per_block = block[0] // tpr
    assert grid[0] * rows_per_block >= 1000 > (grid[0] - 1) * rows_per_block
    nvec = cols // v
    cached = tpr * vpt >= nvec
    assert cached or (vpt == plans.MAX_VPT and tpr == max_threads)  # else the kernel takes its looping path
    if cached and nvec > 256:
        assert vpt > 1 or tpr <= 256                               # wide rows ask for more vectors per thread


def test_row_plan_override(monkeypatch):
    monkeypatch.setattr(loader, "get_function", lambda stem, name, dtype=None: _FakeKernel(1024))
    monkeypatch.setattr(plans, "vpt_override", 2)
    _, _, _, tpr = plans.row_plan("softmax", "softmax_fwd", np.float32, 8, 3072, 4)
    assert tpr == plans.row_tpr(768, 2)


def test_max_vpt_matches_header():
    text = (loader.CUDA_SRC / "common.cuh").read_text()
    assert int(re.search(r"#define MAX_VPT (\d+)", text).group(1)) == plans.MAX_VPT


def test_cdiv_and_int_arguments():
    assert plans.cdiv(10, 3) == 4 and plans.cdiv(9, 3) == 3 and plans.cdiv(0, 5) == 0
    with pytest.raises(ValueError, match="int32"):
        launching.i32(2 ** 31)


@pytest.mark.gpu
def test_nvrtc_error_reports_file_and_line(monkeypatch, tmp_path):
    (tmp_path / "common.cuh").write_text((loader.CUDA_SRC / "common.cuh").read_text())
    (tmp_path / "bad.cu").write_text('#include "common.cuh"\n\ntemplate <typename T>\n__global__ void k(T* x) {\n'
                                     '    x[0] = undefined_name;\n}\n')
    monkeypatch.setattr(loader, "CUDA_SRC", tmp_path)
    monkeypatch.setattr(loader, "_sources", {})
    with pytest.raises(KernelCompileError, match=r"cuda_src/bad\.cu:5"):
        loader.get_function("bad", "k", np.float32)


@pytest.mark.gpu
def test_every_family_compiles_for_every_dtype():
    import ml_dtypes
    for stem in ("activations", "softmax", "norms", "groupnorm", "modulate", "rope", "adamw", "fp8", "fp8_tensor"):
        for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            for name in loader.template_kernels(stem):
                assert loader.get_function(stem, name, dt) is not None
    for name in ("gn_fwd_finalize", "gn_bwd_finalize"):
        assert loader.get_function("groupnorm", name) is not None


class _SmemKernel:
    """Stands in for a cupy RawKernel: static shared memory and the dynamic limit CUDA starts it with."""

    def __init__(self, static):
        self.shared_size_bytes = static
        self.max_dynamic_shared_size_bytes = 48 * 1024 - static
        self.raised = []

    def __setattr__(self, name, value):
        if name == "max_dynamic_shared_size_bytes" and hasattr(self, "raised"):
            self.raised.append(value)
        object.__setattr__(self, name, value)


@pytest.mark.parametrize("static,dynamic,raised", [(0, 48 * 1024, []), (0, 48 * 1024 + 16, [48 * 1024 + 16]),
                                                   (1024, 48 * 1024, [48 * 1024]), (1024, 47 * 1024, []),
                                                   (1024, 60 * 1024, [60 * 1024])])
def test_dynamic_shared_memory_limit_counts_static_shared_memory(static, dynamic, raised):
    # a launch of 48 KiB of dynamic shared memory beside a static array needs the raised limit (the bulk-copy norm
    # backward at 4 stages of 3072-wide bf16 rows: 49152 bytes + its reduction array failed without it)
    k = _SmemKernel(static)
    assert launching.allow_dynamic_smem(k, dynamic) == dynamic
    assert k.raised == raised


@pytest.mark.gpu
def test_arch_kernel_reads_its_shared_memory_attributes_from_the_driver():
    # the sm_90a kernels (_ArchKernel) report static shared memory and the dynamic limit like a cupy.RawKernel, so
    # allow_dynamic_smem treats them alike; a raised limit reaches the driver
    if not loader.arch_available("sm_90a"):
        pytest.skip("sm_90a kernels need a compute capability 9.0 GPU")
    import ml_dtypes

    from flame_core.kernels import attention
    drv = backend.cupy.cuda.driver
    bn, nwg, stages = attention.FWD_SM90_TILES[64]
    fn = loader.get_function("flash_attention_fwd_sm90", f"flash_attn_fwd_sm90<{{T}}, 64, {bn}, {nwg}, {stages}, 0>",
                             np.dtype(ml_dtypes.bfloat16))
    assert isinstance(fn, loader._ArchKernel)
    limit = drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert fn.shared_size_bytes == drv.funcGetAttribute(1, fn._fn.ptr)  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
    assert fn.max_dynamic_shared_size_bytes == drv.funcGetAttribute(limit, fn._fn.ptr)
    want = max(fn.max_dynamic_shared_size_bytes, 48 * 1024) + 1024
    assert launching.allow_dynamic_smem(fn, want) == want
    assert fn.max_dynamic_shared_size_bytes == want == drv.funcGetAttribute(limit, fn._fn.ptr)
