"""One-launch Lion / AdamWScheduleFree / Prodigy steps (flame_core.kernels.optim_multi): each optimizer's fused GPU
step against its per-operation path (the same class inside loader.reference()), and the table's argument errors."""
import numpy as np
import pytest

from flame_core.errors import ShapeError
from flame_core.kernels import optim_multi as K

SIZES = [1, 255, 4096, 4097, 9000, 70001]


def _run(make, steps, zero_every=3, seed=3):
    """Parameters of SIZES (every `zero_every`-th all zero, as a LoRA's up matrices), `steps` steps with random
    fp32 gradients; returns the weights, the states and the param groups' scalars."""
    import flame_core as flame
    import flame_nn as nn
    rng = np.random.default_rng(seed)
    params = []
    for i, n in enumerate(SIZES):
        a = np.zeros(n, np.float32) if i % zero_every == 1 else rng.standard_normal(n).astype(np.float32)
        params.append(nn.Parameter(flame.tensor(a.reshape(1, -1) if n % 2 else a, device="cuda")))
    opt = make(params)
    if hasattr(opt, "train"):
        opt.train()
    for _ in range(steps):
        for p in params:
            p.grad = flame.tensor((rng.standard_normal(p.shape) * rng.choice([1e-3, 1.0])).astype(np.float32),
                                  device="cuda")
        opt.step()
    states = [{k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in opt.state[p].items()} for p in params]
    scalars = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [p.detach().numpy() for p in params], states, scalars


def _both(make, steps=3):
    from flame_core.kernels import launching, loader
    before = launching.launches
    fused = _run(make, steps)
    launched = launching.launches - before
    with loader.reference():
        before = launching.launches
        ref = _run(make, steps)
        assert launching.launches == before, "the reference path launched a kernel"
    return fused, ref, launched


OPTIMIZERS = {
    "lion": lambda ps: __import__("flame_nn").optim.Lion(ps, lr=1e-3, weight_decay=0.1),
    "lion_decoupled": lambda ps: __import__("flame_nn").optim.Lion(ps, lr=1e-3, weight_decay=1e-4,
                                                                    decoupled_weight_decay=True),
    "schedulefree": lambda ps: __import__("flame_nn").optim.AdamWScheduleFree(ps, lr=1e-2, warmup_steps=2,
                                                                              weight_decay=0.01),
    "schedulefree_r": lambda ps: __import__("flame_nn").optim.AdamWScheduleFree(ps, lr=1e-2, r=0.5),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_elementwise_fused_steps_equal_the_per_operation_path(name):
    (wk, sk, gk), (wr, sr, gr), launched = _both(OPTIMIZERS[name])
    assert launched >= 3  # the kernel ran each step
    assert gk == gr
    for n, a, b, s, r in zip(SIZES, wk, wr, sk, sr):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: weights of the {n}-element tensor")
        assert set(s) == set(r)
        for k in s:
            np.testing.assert_array_equal(s[k], r[k], err_msg=f"{name}: {k} of the {n}-element tensor")


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.01}, {"safeguard_warmup": True, "use_bias_correction": True}])
def test_prodigy_fused_step_matches_the_per_operation_path(kw):
    import flame_nn as nn
    (wk, sk, gk), (wr, sr, gr), launched = _both(lambda ps: nn.optim.Prodigy(ps, lr=1.0, **kw), steps=4)
    assert launched == 2 * 4  # two launches a step
    # d comes from two sums over every element, reduced in another order than the per-tensor dots: close, not equal
    for k in ("d", "d_max", "d_numerator", "d_denom", "d_hat"):
        np.testing.assert_allclose(gk[0][k], gr[0][k], rtol=1e-4, err_msg=k)
    assert gk[0]["k"] == gr[0]["k"] == 4
    for n, a, b, s, r in zip(SIZES, wk, wr, sk, sr):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"weights of the {n}-element tensor")
        assert set(s) == set(r) and s["step"] == r["step"] == 4
        for k in ("exp_avg", "exp_avg_sq", "s"):
            np.testing.assert_allclose(s[k], r[k], rtol=1e-4, atol=1e-12, err_msg=f"{k} of the {n}-element tensor")


@pytest.mark.gpu
def test_one_launch_per_step_and_cached_tables():
    import flame_core as flame
    import flame_nn as nn
    from flame_core.kernels import launching
    params = [nn.Parameter(flame.randn(n, device="cuda")) for n in SIZES]
    opt = nn.optim.Lion(params, lr=1e-4)
    for _ in range(3):
        for p in params:
            p.grad = flame.randn(*p.shape, device="cuda")  # new gradient arrays: the table re-points them
        before = launching.launches
        opt.step()
        assert launching.launches - before == 1
    assert len(opt._tables.tables) == 1


def test_table_errors_name_the_tensor_and_field():
    p = np.zeros(300, np.float32)
    with pytest.raises(ShapeError, match="no tensors"):
        K.optim_table([])
    with pytest.raises(ShapeError, match="tensor 0's parameter must be on the GPU"):
        K.optim_table([(p, p, p)])
    with pytest.raises(ShapeError, match="at most 4"):
        K.optim_table([(p, p, p, p, p, p, p)])


AF_SHAPES = [(16, 300), (300, 16), (1, 255), (64,), (16, 5000), (33, 70), (70001,), (2, 3, 4), (320, 64, 3, 3),
             (40, 7, 1, 1), (3, 2, 17)]


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kw", [{}, {"lr": 1e-3, "relative_step": False, "scale_parameter": False, "beta1": 0.9,
                                     "weight_decay": 0.01}])
def test_adafactor_fused_step_matches_the_per_operation_path(kw, bf16):
    """Row / column sums by atomics and rsqrt: close to the per-operation path, not equal. (16, 5000): rows wider
    than a block's chunk (the chunk's columns are a run that wraps); (64,), (70001,): unfactored; (2, 3, 4),
    (320, 64, 3, 3), (40, 7, 1, 1): batches of small matrices (a thread each; matrices across chunk boundaries);
    (3, 2, 17) per operation. bfloat16 weights (full_bf16): stochastically rounded with the per-operation path's
    bits, so equal but for a rare element whose float32 value fell on the other side of its random threshold (one
    bf16 step)."""
    import flame_core as flame
    import flame_nn as nn
    from flame_core.kernels import launching, loader

    def run():
        rng = np.random.default_rng(5)
        params = [nn.Parameter(flame.tensor(rng.standard_normal(s).astype(np.float32), device="cuda",
                                            dtype=flame.bfloat16 if bf16 else None)) for s in AF_SHAPES]
        opt = nn.optim.Adafactor(params, **kw)
        for _ in range(4):
            for p in params:
                p.grad = flame.tensor(rng.standard_normal(p.shape).astype(np.float32), device="cuda",
                                      dtype=p.dtype)
            opt.step()
        return [p.detach().float().numpy() for p in params], [opt.state[p] for p in params]
    before = launching.launches
    fw, fs = run()
    assert launching.launches - before >= 4 * 4
    with loader.reference():
        rw, rs = run()
    for shape, a, b, s, r in zip(AF_SHAPES, fw, rw, fs, rs):
        if bf16:
            assert np.mean(a != b) < 0.01, f"weights {shape}"
            np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-30, err_msg=f"weights {shape}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=f"weights {shape}")
        assert s["step"] == r["step"] == 4
        assert isinstance(s["RMS"], float) == (shape == (3, 2, 17)), shape   # (the fused path's is a 0-d tensor)
        np.testing.assert_allclose(float(s["RMS"]), float(r["RMS"]), rtol=1e-5)
        for k in set(s) - {"step", "RMS"}:
            np.testing.assert_allclose(s[k].numpy(), r[k].numpy(), rtol=1e-4 if not bf16 else 2e-2, atol=1e-9,
                                       err_msg=f"{k} {shape}")


@pytest.mark.gpu
def test_adafactor_bf16_weights_take_the_float32_update_stochastically_rounded():
    """One step from the same values: the bfloat16 run's weights are the float32 run's new values rounded with
    sr_bits(step, salt, i) (salt: the parameter's ordinal) -- all but the rare element an atomic sum's order
    moved across its threshold."""
    import flame_core as flame
    import flame_nn as nn
    from flame_core.kernels.stochastic_rounding import to_bf16_stochastic
    rng = np.random.default_rng(7)
    shapes = [(40, 300), (3000,), (16, 5000)]
    # values a bfloat16 holds exactly: both runs start from the same weights
    w0 = [rng.standard_normal(s).astype(flame.bfloat16.np).astype(np.float32) for s in shapes]
    g0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    out = {}
    for dt in (None, flame.bfloat16):
        ps = [nn.Parameter(flame.tensor(w, device="cuda", dtype=dt)) for w in w0]
        opt = nn.optim.Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False)
        for p, g in zip(ps, g0):
            p.grad = flame.tensor(g, device="cuda")
        opt.step()
        out[dt] = [p.detach().numpy() for p in ps]
    for k, shape in enumerate(shapes):
        want = to_bf16_stochastic(out[None][k], 1, k).astype(np.float32)   # seed: the step; salt: the ordinal
        got = out[flame.bfloat16][k].astype(np.float32)
        assert np.mean(got != want) < 0.01, shape
        moved = np.mean(got != w0[k])
        assert moved > 0.3, f"{shape}: only {moved:.0%} of the weights moved"
def test_block_rows_list_every_chunk_of_every_tensor_in_order():
    from flame_core.kernels.tensor_table import block_rows
    sizes, chunk = [1, 0, 4096, 4097, 9000, 3], 4096
    want_t, want_s = [], []
    for t, n in enumerate(sizes):
        for s in range(0, n, chunk):
            want_t.append(t)
            want_s.append(s)
    got_t, got_s = block_rows(sizes, chunk)
    assert got_t.dtype == np.int32 and got_s.dtype == np.int64
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_array_equal(got_s, want_s)
