"""The fused fp8-compute paths (flame_nn.offload.fp8_compute.Float8ComputeLowRank): Linear.forward_split and plain
LoRAs on an fp8-compute layer as one node. Against the unfused fp8 path (FUSED off / fuse_lora off: the Split node's
concatenating backward, the LoRA deltas added through the graph) on the same quantised operands, and against float64
products of the quantised operands (hypothesis over shapes, splits, row blocks, bias, parts without a gradient); the
parts quantisation (fp8_tensor.quantize_parts_per_tensor) bit for bit against quantising the concatenation. On cpu
the GEMM is emulated; with FLAME_DEVICE=cuda the same tests run cuBLASLt's (and the parts kernel, when switched on)."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from offload_helpers import flux_inputs, npy, tiny_flux

import flame_core as flame
import flame_nn as nn
from flame_core import backend
from flame_core.amp import autocast
from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import fp8_tensor as T
from flame_nn import adapters as A
from flame_nn.offload import fp8_compute as FC
from flame_nn.offload import quantize_linear_weights_

BF16 = np.dtype(ml_dtypes.bfloat16)


def _cuda(device):
    return flame.device(device).type == "cuda"


def _e4m3(q):
    return backend.to_numpy(q).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _quantised(a):
    q, s = T.quantize_per_tensor(a)
    return _e4m3(q) * float(backend.to_numpy(s)[0])


def _fp8_layer(device, n_in, n_out, bias, dtype, blocks=(), rank=4, seed=0):
    """An fp8-compute Linear of compute dtype `dtype`, with one LoRA (random A and B) per (lo, hi) row block."""
    rng = np.random.default_rng(seed)
    lin = nn.Linear(n_in, n_out, bias=bias, device=device, dtype=dtype)
    with flame.no_grad():
        lin.weight.copy_(flame.tensor(0.05 * rng.standard_normal((n_out, n_in)), dtype=dtype, device=device))
        if bias:
            lin.bias.copy_(flame.tensor(rng.standard_normal(n_out), dtype=dtype, device=device))
    lin.requires_grad_(False)
    if blocks:
        A.adapt(lin)
        for lo, hi in blocks:
            ad = A.LoRA(n_in, hi - lo, rank=rank, alpha=rank * 0.75, dtype=dtype, device=device)
            with flame.no_grad():
                ad.lora_A.copy_(flame.tensor(0.3 * rng.standard_normal((rank, n_in)), dtype=dtype, device=device))
                ad.lora_B.copy_(flame.tensor(0.3 * rng.standard_normal((hi - lo, rank)), dtype=dtype,
                                             device=device))
            lin.add_adapter("default", ad, rows=(lo, hi))
    assert quantize_linear_weights_(lin, compute="fp8") == [""] and lin.fp8_compute
    return lin


def _adapter_params(lin):
    if not hasattr(lin, "_adapters"):
        return []
    return [p for entries in lin._adapters.values() for _, ad in entries for p in (ad.lora_A, ad.lora_B)]


def _run(lin, x, splits, fused, grad_parts=None, bias_grad=False, amp=False):
    """(outputs, dx, adapter grads, bias grad) of sum_p sum(y_p * r_p) over the parts in `grad_parts` (all: None),
    through the fused path or the unfused one."""
    FC.FUSED = fused
    if hasattr(lin, "fuse_lora"):
        lin.fuse_lora = fused
    for p in _adapter_params(lin):
        p.grad = None
    if lin.bias is not None:
        lin.bias.grad = None
        lin.bias.requires_grad_(bias_grad)
    x = x.detach().requires_grad_(True)
    try:
        with autocast(flame.device(x.device).type, dtype=flame.bfloat16, enabled=amp):
            ys = lin.forward_split(x, splits) if splits else (lin(x),)
    finally:
        FC.FUSED = True
    kind = ys[0].grad_fn.name()
    rng = np.random.default_rng(9)
    loss = None
    for i, y in enumerate(ys):
        r = flame.tensor(rng.standard_normal(tuple(y.shape)), dtype=y.dtype, device=y.device)
        if grad_parts is None or i in grad_parts:
            term = (y.float() * r.float()).sum()
            loss = term if loss is None else loss + term
    loss.backward()
    grads = [npy(p.grad).astype(np.float64) for p in _adapter_params(lin)]
    db = npy(lin.bias.grad).astype(np.float64) if bias_grad else None
    return [npy(y).astype(np.float64) for y in ys], npy(x.grad).astype(np.float64), grads, db, kind


def _fused_kind(kind):
    return "Float8ComputeLowRank" in kind


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grad_parts", [None, (0, 3)])
@pytest.mark.parametrize("amp", [False, True])
def test_forward_split_equals_unfused_bit_for_bit(device, rng, bias, grad_parts, amp):
    """No adapters: the same quantised operands and the same GEMMs, so the same bits (the unfused path concatenates
    the parts' gradients, zeros where a part got none, and quantises that; the fused one quantises the parts)."""
    splits = (32, 32, 32, 64)
    dtype = flame.float32
    lin = _fp8_layer(device, 48, sum(splits), bias, dtype)
    x = flame.tensor(rng.standard_normal((2, 7, 48)), dtype=dtype, device=device)
    fy, fdx, _, fdb, fkind = _run(lin, x, splits, True, grad_parts, bias_grad=bias, amp=amp)
    uy, udx, _, udb, ukind = _run(lin, x, splits, False, grad_parts, bias_grad=bias, amp=amp)
    assert _fused_kind(fkind) and not _fused_kind(ukind)
    for a, b in zip(fy, uy):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fdx, udx)
    if bias:   # summed in float32 by both (the fused path per part)
        np.testing.assert_allclose(fdb, udb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_fused_lora_equals_unfused(device, rng, bias, split):
    """LoRAs on the q, k and v row blocks of an fp8 qkv projection: the fused node against the deltas added through
    the graph, float32 compute (the base's operands quantised alike; only where the rank-r products are added
    differs: inside the GEMM's accumulation or as a separate add)."""
    H = 32
    lin = _fp8_layer(device, 48, 3 * H, bias, flame.float32, blocks=((0, H), (H, 2 * H), (2 * H, 3 * H)))
    x = flame.tensor(rng.standard_normal((3, 5, 48)), dtype=flame.float32, device=device)
    splits = (H, H, H) if split else None
    fy, fdx, fg, fdb, fkind = _run(lin, x, splits, True, bias_grad=bias)
    uy, udx, ug, udb, ukind = _run(lin, x, splits, False, bias_grad=bias)
    assert _fused_kind(fkind) and not _fused_kind(ukind)
    tol = dict(rtol=1e-4, atol=1e-4) if _cuda(device) else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(fy, uy):
        np.testing.assert_allclose(a, b, **tol)
    np.testing.assert_allclose(fdx, udx, **tol)
    assert len(fg) == len(ug) == 6
    for a, b in zip(fg, ug):
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(a, b, **tol)
    if bias:
        np.testing.assert_allclose(fdb, udb, **tol)


def test_fused_lora_under_bf16_autocast_within_bf16_rounding(device, rng):
    """The bench's setting: float32 adapters, bf16 autocast, a bf16 base in fp8 compute, single-block-like split with
    LoRAs on q | k | v only."""
    H, M = 32, 64
    lin = _fp8_layer(device, 48, 3 * H + M, True, flame.bfloat16, blocks=((0, H), (H, 2 * H), (2 * H, 3 * H)))
    for p in _adapter_params(lin):   # float32 adapter parameters, as injected
        p.data = p.detach().float()
    x = flame.tensor(rng.standard_normal((2, 9, 48)), dtype=flame.bfloat16, device=device)
    splits = (H, H, H, M)
    fy, fdx, fg, _, fkind = _run(lin, x, splits, True, amp=True)
    uy, udx, ug, _, ukind = _run(lin, x, splits, False, amp=True)
    assert _fused_kind(fkind) and not _fused_kind(ukind)

    def close(a, b):   # a few bf16 roundings apart
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), np.linalg.norm(a - b) / np.linalg.norm(b)
    for a, b in zip(fy, uy):
        close(a, b)
    close(fdx, udx)
    for a, b in zip(fg, ug):
        close(a, b)


def test_switch_off_falls_back_and_dequantising_layers_stay_unfused(device, rng):
    lin = _fp8_layer(device, 32, 48, False, flame.float32)
    x = flame.tensor(rng.standard_normal((4, 32)), dtype=flame.float32, device=device, requires_grad=True)
    FC.FUSED = False
    try:
        assert lin.forward_split(x, (16, 32))[0].grad_fn.name() == "SplitBackward"
    finally:
        FC.FUSED = True
    assert lin.forward_split(x, (16, 32))[0].grad_fn.name() == "Float8ComputeLowRankBackward"
    storage = nn.Linear(32, 48, device=device, dtype=flame.float32)
    storage.requires_grad_(False)
    quantize_linear_weights_(storage)           # fp8 storage, dequantising: no fused form
    assert storage.fused_low_rank(x, []) is None
    assert storage.forward_split(x, (16, 32))[0].grad_fn.name() == "SplitBackward"


@st.composite
def _geometry(draw):
    n_in = 16 * draw(st.integers(1, 3))
    sizes = draw(st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=4))
    n_out = sum(sizes)
    splits = tuple(sizes) if draw(st.booleans()) else None
    # LoRA row blocks, each inside one split part
    bounds, lo = [], 0
    for n in sizes:
        bounds.append((lo, lo + n))
        lo += n
    blocks = []
    for p0, p1 in bounds:
        if draw(st.booleans()):
            a = draw(st.integers(p0, p1 - 1))
            blocks.append((a, draw(st.integers(a + 1, p1))))
    dropped = tuple(i for i in range(len(sizes)) if splits and len(sizes) > 1 and draw(st.booleans()))
    if len(dropped) == len(sizes):
        dropped = dropped[1:]
    lead = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))
    return n_in, splits or (n_out,), splits is not None, blocks, dropped, draw(st.booleans()), lead


@settings(max_examples=20, deadline=None)
@given(_geometry())
def test_fused_against_float64_of_the_quantised_operands(geometry):
    """y = Q(x) W_q^T s + b + sum_i s_i (x A_i^T) B_i^T and every gradient -- dx through the quantised joined output
    gradient (zero columns where a part got none), dA_i, dB_i, db -- in float64, against the fused node in float32."""
    device = flame.default_device()   # the device fixture's (a hypothesis test takes no function-scoped fixture)
    n_in, sizes, split, blocks, dropped, bias, lead = geometry
    n_out = sum(sizes)
    lin = _fp8_layer(device, n_in, n_out, bias, flame.float32, blocks=blocks, rank=3, seed=len(blocks))
    if bias:
        lin.bias.requires_grad_(True)
    rng = np.random.default_rng(5)
    x = flame.tensor(rng.standard_normal(lead + (n_in,)), dtype=flame.float32, device=device, requires_grad=True)
    ys = lin.forward_split(x, sizes) if split else (lin(x),)
    fused = split or blocks   # else the plain fp8 layer's own node
    assert ys[0].grad_fn.name() == ("Float8ComputeLowRankBackward" if fused else "Float8ComputeLinearBackward")
    rs = [rng.standard_normal(tuple(y.shape)) for y in ys]
    loss = None
    for i, (y, r) in enumerate(zip(ys, rs)):
        if i not in dropped:
            term = (y * flame.tensor(r, dtype=flame.float32, device=device)).sum()
            loss = term if loss is None else loss + term
    loss.backward()

    xd = npy(x).astype(np.float64).reshape(-1, n_in)
    w = _e4m3(lin.weight.array) * float(npy(lin.weight_scale)[0])
    xq = _quantised(x.detach().array.reshape(-1, n_in))
    ads = [(lo, hi, ad) for (lo, hi), ad in lin._adapters["default"]] if blocks else []
    want = xq @ w.T + (npy(lin.bias).astype(np.float64) if bias else 0)
    mag = np.abs(xq) @ np.abs(w).T
    for lo, hi, ad in ads:
        a, b = npy(ad.lora_A).astype(np.float64), npy(ad.lora_B).astype(np.float64)
        want[:, lo:hi] += ad.scale * (xd @ a.T) @ b.T
        mag[:, lo:hi] += ad.scale * np.abs(xd @ a.T) @ np.abs(b).T
    got = np.concatenate([npy(y).astype(np.float64).reshape(xd.shape[0], -1) for y in ys], axis=1)
    cuda = _cuda(device)
    acc = 2.0 ** -8 if cuda else 1e-5          # the forward's fast accumulation on cuda
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(want) + acc * mag + 1e-6)

    g = np.concatenate([np.zeros_like(r) if i in dropped else r for i, r in enumerate(rs)], axis=-1)
    g = g.reshape(-1, n_out)
    gq = _quantised(g.astype(np.float32))
    dx = gq @ w
    dmag = np.abs(gq) @ np.abs(w)
    acc = 2.0 ** -12 if cuda else 1e-5
    for lo, hi, ad in ads:
        a, b = npy(ad.lora_A).astype(np.float64), npy(ad.lora_B).astype(np.float64)
        gi = g[:, lo:hi]
        dx += ad.scale * (gi @ b) @ a
        dmag += ad.scale * np.abs(gi @ b) @ np.abs(a)
        np.testing.assert_allclose(npy(ad.lora_A.grad), ad.scale * (gi @ b).T @ xd, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(npy(ad.lora_B.grad), ad.scale * gi.T @ (xd @ a.T), rtol=1e-4, atol=1e-4)
    gx = npy(x.grad).astype(np.float64).reshape(-1, n_in)
    assert np.all(np.abs(gx - dx) <= 1e-6 * np.abs(dx) + acc * dmag + 1e-6)
    if bias:
        np.testing.assert_allclose(npy(lin.bias.grad), g.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("widths", [(16, 16, 16, 48), (24, 8), (5, 11, 3), (32,)])
@pytest.mark.parametrize("kernel", [False, True], ids=["gather", "parts_kernel"])
def test_quantize_parts_equals_quantizing_the_concatenation(device, rng, dtype, widths, kernel, monkeypatch):
    monkeypatch.setattr(T, "PARTS_KERNEL", kernel)
    xp = backend.xp_of(flame.zeros(1, device=device).array)
    rows = 37
    parts = [xp.asarray((rng.standard_normal((rows, c)) * (1 + 3 * i)).astype(dtype)) for i, c in enumerate(widths)]
    q, s = T.quantize_parts_per_tensor(parts)
    q0, s0 = T.quantize_per_tensor(xp.concatenate(parts, axis=1))
    assert tuple(q.shape) == (rows, sum(widths))
    np.testing.assert_array_equal(backend.to_numpy(q), backend.to_numpy(q0))
    np.testing.assert_array_equal(backend.to_numpy(s), backend.to_numpy(s0))


def test_quantize_parts_checks(device):
    xp = backend.xp_of(flame.zeros(1, device=device).array)
    with pytest.raises(ShapeError, match="one row count"):
        T.quantize_parts_per_tensor([xp.zeros((3, 4), np.float32), xp.zeros((2, 4), np.float32)])
    with pytest.raises(DTypeError, match="one float16/bfloat16/float32 dtype"):
        T.quantize_parts_per_tensor([xp.zeros((3, 4), np.float32), xp.zeros((3, 4), np.float16)])


def _tiny_step(device, fused, amp):
    args = flux_inputs(device, height=64, width=64, n_txt=8)
    model = tiny_flux(device)
    for stack in (model.double_blocks, model.single_blocks):
        quantize_linear_weights_(stack, compute="fp8")
    FC.FUSED = fused
    try:
        with autocast(flame.device(device).type, dtype=flame.bfloat16, enabled=amp):
            out = model(**args)
    finally:
        FC.FUSED = True
    (out.float() * out.float()).mean().backward()
    return npy(out).astype(np.float64), [npy(p.grad).astype(np.float64) for p in A.adapter_parameters(model)]


@pytest.mark.parametrize("amp", [False, True])
def test_tiny_flux_lora_step_fused_equals_unfused(device, amp):
    """The whole model (double blocks' qkv with q / k / v LoRAs, single blocks' linear1 split four ways): the fused
    fp8 paths give the unfused fp8 step's output and adapter gradients. float32 compute: to float32 rounding (the
    LoRA products summed in another order; an activation that lands on an e4m3 rounding boundary would flip a whole
    e4m3 step, which float32 differences make unlikely). bf16 autocast: the unfused path rounds each LoRA delta to
    bf16 before adding it, the fused one accumulates it in the GEMM; those bf16-sized differences then move later
    activations across e4m3 rounding boundaries (a whole e4m3 step, ~6%, where one lands): a few % at the output of
    this tiny model with its deliberately large weights (measured 2.7%)."""
    out_f, g_f = _tiny_step(device, True, amp)
    out_u, g_u = _tiny_step(device, False, amp)
    tol, cos_min = (0.06, 0.97) if amp else (1e-4, 1 - 1e-6)
    assert np.linalg.norm(out_f - out_u) <= tol * np.linalg.norm(out_u)
    assert len(g_f) == len(g_u) > 0
    cos = [float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(g_f, g_u)]
    assert min(cos) > cos_min, cos


def _run_cat2(lin, a, b, fused, bias_grad=False, amp=False):
    FC.FUSED = fused
    if lin.bias is not None:
        lin.bias.grad = None
        lin.bias.requires_grad_(bias_grad)
    a = a.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True)
    try:
        with autocast(flame.device(a.device).type, dtype=flame.bfloat16, enabled=amp):
            y = lin.forward_cat2(a, b)
    finally:
        FC.FUSED = True
    r = flame.tensor(np.random.default_rng(3).standard_normal(tuple(y.shape)), dtype=y.dtype, device=y.device)
    (y.float() * r.float()).sum().backward()
    db = npy(lin.bias.grad).astype(np.float64) if bias_grad else None
    return (npy(y).astype(np.float64), npy(a.grad).astype(np.float64), npy(b.grad).astype(np.float64), db,
            y.grad_fn.name())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amp", [False, True])
def test_forward_cat2_equals_unfused(device, rng, bias, amp):
    """linear2(cat(attn, mlp)) of an fp8-compute layer: the inputs quantised side by side with one amax (the same
    bits as quantising the concatenation), the input gradients from two GEMMs on W^T's row blocks: the unfused
    node's numbers (cpu: bit for bit; cuda: each GEMM may take another algorithm, so to the accumulation)."""
    lin = _fp8_layer(device, 48 + 80, 32, bias, flame.float32)
    a = flame.tensor(rng.standard_normal((2, 5, 48)), dtype=flame.float32, device=device)
    b = flame.tensor(3 * rng.standard_normal((2, 5, 80)), dtype=flame.float32, device=device)
    fused = _run_cat2(lin, a, b, True, bias, amp)
    unfused = _run_cat2(lin, a, b, False, bias, amp)
    assert fused[-1] == "Float8ComputeCat2Backward" and unfused[-1] != fused[-1]
    tol = dict(rtol=2e-2, atol=2e-2) if _cuda(device) and amp else dict(rtol=1e-5, atol=1e-5)
    for x, y in zip(fused[:3], unfused[:3]):
        if _cuda(device):
            np.testing.assert_allclose(x, y, **tol)
        else:
            np.testing.assert_array_equal(x, y)
    if bias:
        np.testing.assert_allclose(fused[3], unfused[3], rtol=1e-5, atol=1e-5)


def test_forward_cat2_against_float64_and_its_fallbacks(device, rng):
    lin = _fp8_layer(device, 32 + 16, 24, True, flame.float32)
    a = flame.tensor(rng.standard_normal((7, 32)), dtype=flame.float32, device=device)
    b = flame.tensor(rng.standard_normal((7, 16)), dtype=flame.float32, device=device)
    y, da, db, _, kind = _run_cat2(lin, a, b, True)
    assert kind == "Float8ComputeCat2Backward"
    w = _e4m3(lin.weight.array) * float(npy(lin.weight_scale)[0])
    xq = _quantised(np.concatenate([npy(a), npy(b)], axis=1).astype(np.float32))
    want = xq @ w.T + npy(lin.bias)
    acc = 2.0 ** -8 if _cuda(device) else 1e-5
    assert np.all(np.abs(y - want) <= 1e-6 * np.abs(want) + acc * (np.abs(xq) @ np.abs(w).T) + 1e-6)
    r = np.random.default_rng(3).standard_normal((7, 24)).astype(np.float32)
    gq = _quantised(r)
    dx = gq @ w
    acc = 2.0 ** -12 if _cuda(device) else 1e-5
    got = np.concatenate([da, db], axis=1)
    assert np.all(np.abs(got - dx) <= 1e-6 * np.abs(dx) + acc * (np.abs(gq) @ np.abs(w)) + 1e-6)
    with pytest.raises(ShapeError, match="do not fit"):
        FC.fp8_linear_cat2(a, b[:, :8], lin.weight, lin.weight_scale, None, np.float32)
    # an adapted linear2 runs its adapters on the concatenation (no fused form)
    A.adapt(lin)
    lin.add_adapter("default", A.LoRA(48, 24, rank=2, dtype=flame.float32, device=device))
    assert lin.fused_cat2(a, b) is None
    assert lin.forward_cat2(a, b).grad_fn is not None
