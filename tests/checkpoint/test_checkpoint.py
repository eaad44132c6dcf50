"""flame_core.checkpoint: recompute-in-backward gives the gradients of the plain graph, replays dropout, works
under autocast, and cuts the activation memory of a block stack."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import amp
from flame_core.checkpoint import checkpoint, checkpoint_sequential, maybe_checkpoint
from flame_core.errors import AutogradError


def _grads(stack, x, seed, dtype_loss=flame.float32, autocast=None):
    """Loss = mean(y^2) of one forward/backward from a fixed RNG seed; returns (y, grads of params and x)."""
    for p in stack.parameters():
        p.grad = None
    x.grad = None
    flame.manual_seed(seed)
    if autocast is not None:
        with amp.autocast(x.device.type, dtype=autocast):
            y = stack(x)
    else:
        y = stack(x)
    (y.to(dtype_loss) ** 2).mean().backward()
    return (y.detach().float().numpy(), [p.grad.float().numpy() for p in stack.parameters()],
            x.grad.float().numpy())


def _assert_close_lists(a, b, rtol, atol):
    assert len(a) == len(b)
    for k, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=f"gradient {k}")


def _stack_and_input(tiny, device, n=4, dim=32, heads=4, p=0.1, dtype=flame.float32):
    st = tiny.Stack(n, dim, heads, device, dtype=dtype, p_drop=p, seed=3)
    x = flame.tensor(np.random.default_rng(7).standard_normal((2, 12, dim)), dtype=dtype, device=device,
                     requires_grad=True)
    return st, x


def test_checkpointed_gradients_match_plain_fp32_with_dropout(tiny, device):
    st, x = _stack_and_input(tiny, device)
    y0, g0, gx0 = _grads(st, x, seed=11)
    after_plain = flame.rand(5, device=device).numpy()
    st.gradient_checkpointing = True
    y1, g1, gx1 = _grads(st, x, seed=11)
    after_ckpt = flame.rand(5, device=device).numpy()
    np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)
    _assert_close_lists(g1, g0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-5, atol=1e-6)
    # the recompute ran on a fork of the RNG: the outer stream is where the plain run left it
    np.testing.assert_array_equal(after_ckpt, after_plain)


def test_dropout_replay_is_what_makes_them_equal(tiny, device):
    st, x = _stack_and_input(tiny, device, n=2, p=0.3)
    _, g0, _ = _grads(st, x, seed=5)

    def run(x):
        for b in st.blocks:
            x = checkpoint(b, x, preserve_rng_state=False)
        return x
    for p in st.parameters():
        p.grad = None
    flame.manual_seed(5)
    (run(x) ** 2).mean().backward()
    g_no_replay = [p.grad.numpy() for p in st.parameters()]
    worst = max(np.abs(a - b).max() / (np.abs(a).max() + 1e-12) for a, b in zip(g0, g_no_replay))
    assert worst > 1e-2, "without RNG replay the recomputed dropout masks should differ"


def test_checkpoint_under_bf16_autocast(tiny, device):
    st, x = _stack_and_input(tiny, device, n=3, p=0.1)
    ref_y, ref_g, ref_gx = _grads(st, x, seed=2)                           # fp32, no autocast
    y0, g0, gx0 = _grads(st, x, seed=2, autocast=flame.bfloat16)           # plain bf16 autocast
    st.gradient_checkpointing = True
    y1, g1, gx1 = _grads(st, x, seed=2, autocast=flame.bfloat16)           # checkpointed bf16 autocast
    # the recompute sees the same casts and masks as the first run
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
    _assert_close_lists(g1, g0, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-3, atol=1e-5)
    # and both are the fp32 gradients up to bf16 rounding (relative error of the whole tensor)
    for k, (a, r) in enumerate(zip(g1 + [gx1], ref_g + [ref_gx])):
        rel = np.linalg.norm(a - r) / np.linalg.norm(r)
        assert rel < 4e-2, f"gradient {k}: relative error {rel:.3g} vs fp32"
    assert np.linalg.norm(y1 - ref_y) / np.linalg.norm(ref_y) < 2e-2


def test_parameters_get_gradients_when_no_input_requires_grad(tiny, device):
    st, x = _stack_and_input(tiny, device, n=2, p=0.0)
    x = x.detach()                                    # a frozen base feeding trainable blocks (LoRA)
    for p in st.parameters():
        p.grad = None
    (st(x) ** 2).mean().backward()
    g0 = [p.grad.numpy() for p in st.parameters()]
    for p in st.parameters():
        p.grad = None
    st.gradient_checkpointing = True
    y = st(x)
    assert y.requires_grad
    (y ** 2).mean().backward()
    _assert_close_lists([p.grad.numpy() for p in st.parameters()], g0, rtol=1e-5, atol=1e-7)


def test_kwargs_tuple_outputs_constants_and_identity(device):
    rng = np.random.default_rng(0)
    a = flame.tensor(rng.standard_normal((3, 4)), device=device, requires_grad=True)
    w = flame.tensor(rng.standard_normal((4, 5)), device=device, requires_grad=True)
    b = flame.tensor(rng.standard_normal((5,)), device=device, requires_grad=True)

    def fn(x, weight, scale, *, bias):
        h = (x @ weight).tanh() * scale + bias
        return h, h.argmax(-1), x                      # a float output, an integer one, an input as is

    def loss_of(outs):
        h, idx, xx = outs
        assert idx.dtype == flame.int64
        return (h ** 2).sum() + (xx * 3.0).sum()

    loss_of(fn(a, w, 2.5, bias=b)).backward()
    ref = [t.grad.numpy().copy() for t in (a, w, b)]
    for t in (a, w, b):
        t.grad = None
    outs = checkpoint(fn, a, w, 2.5, bias=b)
    assert outs[2] is not a and outs[2].grad_fn is not None   # the input was not taken over by the node
    assert a.grad_fn is None and a.is_leaf
    loss_of(outs).backward()
    for r, t in zip(ref, (a, w, b)):
        np.testing.assert_allclose(t.grad.numpy(), r, rtol=1e-6, atol=1e-7)


def test_no_grad_calls_plainly_and_double_backward_raises(device):
    x = flame.randn(4, device=device, requires_grad=True)
    with flame.no_grad():
        y = checkpoint(lambda t: t.exp(), x)
    assert y.grad_fn is None
    y = checkpoint(lambda t: t.exp(), x).sum()
    with pytest.raises(AutogradError, match="double backward"):
        flame.autograd.grad(y, x, create_graph=True)


def test_input_modified_in_place_after_forward_raises(device):
    x = flame.randn(4, device=device, requires_grad=True)
    h = x * 2.0
    y = checkpoint(lambda t: (t * t).sum(), h)
    with flame.no_grad():
        h.add_(1.0)
    with pytest.raises(AutogradError, match="modified by an in-place operation"):
        y.backward()


def test_checkpoint_sequential_matches_plain(tiny, device):
    st, x = _stack_and_input(tiny, device, n=5, p=0.2)
    _, g0, gx0 = _grads(st, x, seed=9)
    for p in st.parameters():
        p.grad = None
    x.grad = None
    flame.manual_seed(9)
    y = checkpoint_sequential(st.blocks, 2, x)
    (y ** 2).mean().backward()
    _assert_close_lists([p.grad.numpy() for p in st.parameters()], g0, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(x.grad.numpy(), gx0, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="segments"):
        checkpoint_sequential(st.blocks, 6, x)


def test_module_is_callable_and_maybe_checkpoint_reads_the_switch(device):
    import flame_core.checkpoint as ckpt
    x = flame.randn(3, device=device, requires_grad=True)
    y = ckpt(lambda t: t.sin(), x)
    assert y.grad_fn.name() == "CheckpointFunctionBackward"
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.cos(x.detach().numpy()), rtol=1e-6)

    class Block:
        gradient_checkpointing = False

        def __call__(self, t):
            return t.sin()
    blk = Block()
    assert maybe_checkpoint(blk, x).grad_fn.name() == "SinBackward"
    blk.gradient_checkpointing = True
    assert maybe_checkpoint(blk, x).grad_fn.name() == "CheckpointFunctionBackward"
    assert maybe_checkpoint(blk, x, enabled=False).grad_fn.name() == "SinBackward"


def test_nested_checkpoints(device):
    rng = np.random.default_rng(1)
    w = flame.tensor(rng.standard_normal((6, 6)) / 3, device=device, requires_grad=True)
    x = flame.tensor(rng.standard_normal((2, 6)), device=device, requires_grad=True)

    def inner(t):
        return (t @ w).tanh()

    def outer(t):
        return checkpoint(inner, checkpoint(inner, t)) * 2.0
    (outer(x) ** 2).sum().backward()
    ref = (w.grad.numpy().copy(), x.grad.numpy().copy())
    w.grad = x.grad = None
    (checkpoint(outer, x) ** 2).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), ref[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(x.grad.numpy(), ref[1], rtol=1e-6, atol=1e-7)


def test_activation_memory_of_16_blocks_drops_3x(tiny, device):
    """16 pre-norm blocks: checkpointing each keeps only the 16 block inputs for backward."""
    B, L, D = 2, 64, 64
    st = tiny.Stack(16, D, 4, device, p_drop=0.1, seed=0)
    x = flame.tensor(np.random.default_rng(0).standard_normal((B, L, D)), dtype=flame.float32, device=device,
                     requires_grad=True)
    params = st.parameters()
    measured = {}
    for ckpt in (False, True):
        st.gradient_checkpointing = ckpt
        with tiny.LiveBytes(device) as probe:
            y = st(x)
            live = probe.now() - probe.start
        saved = tiny.saved_activation_bytes(y, exclude=params)
        measured[ckpt] = (live, saved)
        (y ** 2).mean().backward()            # the recompute path must still run to completion
        del y
    (live0, saved0), (live1, saved1) = measured[False], measured[True]
    block_input = B * L * D * 4
    assert saved1 == 16 * block_input, (saved1, 16 * block_input)
    assert saved0 / saved1 >= 3.0, measured
    print(f"activation bytes plain={live0} ckpt={live1} ({probe.source}); graph-saved plain={saved0} ckpt={saved1}")
    assert live0 / live1 >= 3.0, (measured, probe.source)


@pytest.mark.gpu
def test_offload_to_pinned_host_keeps_gradients_and_frees_device_memory(tiny, device):
    if device.type != "cuda":
        pytest.skip("offload moves cuda tensors to pinned host memory")
    B, L, D = 2, 128, 128
    st = tiny.Stack(6, D, 4, device, p_drop=0.1, seed=0)
    x = flame.tensor(np.random.default_rng(0).standard_normal((B, L, D)), dtype=flame.float32, device=device,
                     requires_grad=True)
    st.gradient_checkpointing = True
    _, g0, gx0 = _grads(st, x, seed=4)
    live = {}
    for off in (False, True):
        st.checkpoint_offload = off
        with tiny.LiveBytes(device) as probe:
            y = st(x)
            live[off] = probe.now() - probe.start
        del y
    st.checkpoint_offload = True
    _, g1, gx1 = _grads(st, x, seed=4)
    _assert_close_lists(g1, g0, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-5, atol=1e-7)
    # the 5 inner block inputs (x itself stays alive either way) left the device
    assert live[False] - live[True] >= 5 * B * L * D * 4 * 0.9, live


def test_an_offload_object_keeps_the_inputs_and_gets_the_gradients_right(device):
    # `offload` may be an object that keeps the region's tensor inputs itself (flame_nn's activation offload): the
    # node saves nothing of them, calls pack in forward and unpack in backward, and the gradients are the plain ones
    class Keeper:
        def __init__(self):
            self.calls = []

        def pack(self, tensors):
            self.calls.append("pack")
            return [t.detach().cpu().numpy().copy() for t in tensors]  # a copy: the originals are not used again

        def unpack(self, packed):
            self.calls.append("unpack")
            return [flame.tensor(a, device=device) for a in packed]

    w = flame.randn(8, 8, device=device, requires_grad=True)
    x = flame.randn(4, 8, device=device, requires_grad=True)

    def region(a, scale):
        return (a @ w).tanh() * scale

    keeper = Keeper()
    y = checkpoint(region, x, 2.0, offload=keeper)
    assert keeper.calls == ["pack"]
    (y * y).sum().backward()
    assert keeper.calls == ["pack", "unpack"]
    got = (w.grad.numpy(), x.grad.numpy())
    w.grad = x.grad = None
    y = region(x, 2.0)
    (y * y).sum().backward()
    np.testing.assert_allclose(got[0], w.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got[1], x.grad.numpy(), rtol=1e-6)
