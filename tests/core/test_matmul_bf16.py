"""matmul of any rank on cuda through FLAME's direct cuBLAS calls (cuBLAS GemmEx / strided-batched; CuPy alone
only does 2-D bf16) against a float64 product, in bf16, fp16 and fp32."""
import numpy as np
import pytest

import flame_core as flame

CASES = [
    ((2, 3, 17, 24), (2, 3, 24, 9), None),       # attention-like batched
    ((2, 3, 17, 24), (2, 3, 24, 9), "bT"),       # q @ k^T: b given transposed (a strided view, no copy)
    ((5, 33, 64), (64, 48), None),               # (B, L, H) @ W
    ((1, 4, 8, 16), (3, 1, 16, 8), None),        # broadcast batch dims
    ((7, 16), (4, 16, 5), None),                 # 2-D @ batched
    ((16,), (3, 16, 2), None),                   # 1-D @ batched
    ((3, 4, 16), (16,), None),                   # batched @ 1-D
    ((2, 6, 10), (2, 10, 6), "aT"),              # a given transposed
]


TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(TOL))
@pytest.mark.parametrize("sa,sb,trans", CASES)
def test_matmul_any_rank(sa, sb, trans, dt):
    dtype = getattr(flame, dt)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    A = flame.tensor(a, device="cuda").to(dtype)
    B = flame.tensor(b, device="cuda").to(dtype)
    if trans == "bT":
        B = flame.tensor(np.swapaxes(b, -1, -2).copy(), device="cuda").to(dtype).transpose(-1, -2)
    if trans == "aT":
        A = flame.tensor(np.swapaxes(a, -1, -2).copy(), device="cuda").to(dtype).transpose(-1, -2)
    ref = A.double().numpy() @ B.double().numpy()
    out = (A @ B)
    assert out.dtype == dtype and out.shape == ref.shape
    err = np.linalg.norm(out.double().numpy() - ref) / np.linalg.norm(ref)
    assert err < TOL[dt], err


@pytest.mark.gpu
def test_matmul_of_non_contiguous_and_broadcast_views():
    rng = np.random.default_rng(3)
    base = flame.tensor(rng.standard_normal((4, 10, 12)), device="cuda").bfloat16()
    a = base[:, ::2, 1:9]                              # (4, 5, 8): neither row- nor column-major
    b = flame.tensor(rng.standard_normal((8, 6)), device="cuda").bfloat16().expand(4, 8, 6)  # batch stride 0
    ref = a.double().numpy() @ b.double().numpy()
    err = np.linalg.norm((a @ b).double().numpy() - ref) / np.linalg.norm(ref)
    assert err < 1e-2


@pytest.mark.gpu
def test_bf16_matmul_backward_batched():
    rng = np.random.default_rng(1)
    a = flame.tensor(rng.standard_normal((2, 3, 8, 16)), device="cuda").bfloat16().requires_grad_()
    b = flame.tensor(rng.standard_normal((16, 4)), device="cuda").bfloat16().requires_grad_()
    (a @ b).float().sum().backward()
    ga = np.broadcast_to(b.detach().float().numpy().sum(-1), (2, 3, 8, 16))
    gb = np.broadcast_to(a.detach().float().numpy().sum((0, 1, 2))[:, None], (16, 4))
    np.testing.assert_allclose(a.grad.float().numpy(), ga, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(b.grad.float().numpy(), gb, rtol=2e-2, atol=1e-1)
