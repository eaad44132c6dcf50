"""A fused backward pass (LayerwiseOptimizer): each streamed block updated inside backward by the wrapped optimizer
equals that optimizer's step over the whole model; per-block clipping, pausing, the finiteness flag, state_dict and
the refusals."""
import numpy as np
import pytest
from offload_helpers import LazyCopyEngine, npy, stack_pair

import flame_core as flame
import flame_nn as nn
from flame_nn.offload import BlockStreamer, LayerwiseOptimizer, OffloadError

OPTIMIZERS = {
    "adafactor": lambda ps: nn.optim.Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False,
                                               weight_decay=0.01),
    "adafactor_scaled": lambda ps: nn.optim.Adafactor(ps, lr=None, relative_step=True, scale_parameter=True),
    "adamw": lambda ps: nn.optim.AdamW(ps, lr=3e-2, weight_decay=0.1),
    "adamw8bit": lambda ps: nn.optim.AdamW8bit(ps, lr=3e-2, weight_decay=0.1),
    "lion": lambda ps: nn.optim.Lion(ps, lr=1e-3, weight_decay=0.1),
}


def all_weights(model, streamer):
    out = {k: npy(v) for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    out.update({k: npy(v) for k, v in streamer.state_dict().items()})
    return out


def layerwise(net, device, make, resident=(), lazy=False, **kw):
    st = BlockStreamer(net.blocks, resident=resident, device=device, stream_trainable=True, prefixes=["blocks"])
    opt = LayerwiseOptimizer(st, make(list(net.parameters())), **kw)
    if lazy:  # copies (weights in, new weights out) run as late as the events allow
        st.engine = LazyCopyEngine(st.engine)
    return st, opt


def loss_of(model, x):
    y = model(x)
    return y.float().square().mean()


def step_both(ref, opt_ref, net, opt, x, clip=None):
    """One training step of the reference model with its plain optimizer (`clip(ref)` between backward and step) and
    of the streamed one with its layer-wise optimizer."""
    loss_of(ref, x).backward()
    if clip is not None:
        clip(ref)
    opt_ref.step()
    opt_ref.zero_grad()
    loss_of(net, x).backward()
    opt.step()
    opt.zero_grad()


def block_clipped(model, max_norm):
    """The reference of LayerwiseOptimizer's clipping: each block's gradients by their own norm."""
    for b in model.blocks:
        nn.utils.clip_grad_norm_(b.parameters(), max_norm)


@pytest.mark.parametrize("name,resident,lazy", [("adafactor", (), False), ("adafactor", (1, 3), True),
                                                ("adafactor_scaled", (), True), ("adamw", (2,), False),
                                                ("adamw8bit", (), False), ("lion", (), True)])
def test_each_block_updated_in_backward_equals_a_step_over_the_whole_model(device, name, resident, lazy):
    ref, net = stack_pair(16, 5, device, seed=3)
    x = flame.randn(6, 16, device=device)
    opt_ref = OPTIMIZERS[name](list(ref.parameters()))
    st, opt = layerwise(net, device, OPTIMIZERS[name], resident, lazy)
    for step in range(3):
        loss_of(ref, x).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss_of(net, x).backward()
        assert all(p.grad is None for p in net.blocks.parameters())  # consumed by the update and released
        assert opt.block_steps == 5 * (step + 1)
        opt.step()
        opt.zero_grad()
        want, got = {k: npy(v) for k, v in ref.state_dict().items()}, all_weights(net, st)
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=2e-6, err_msg=f"{name} step {step} {k}")
            assert not np.array_equal(want[k], npy(stack_pair(16, 5, device, seed=3)[0].state_dict()[k])), k
    assert bool(opt.grads_finite().item())
    with flame.no_grad():
        np.testing.assert_allclose(npy(net(x)), npy(ref(x)), rtol=1e-5, atol=1e-5)


def test_bf16_weights_round_as_the_whole_step_does(device):
    """Adafactor's stochastic rounding of bf16 weights: each parameter keeps its salt (its ordinal among all the
    optimizer's parameters) within a block's restricted step, so the bits land where a whole step puts them."""
    ref, net = stack_pair(16, 4, device, dtype=flame.bfloat16, seed=5)
    x = flame.randn(4, 16, device=device, dtype=flame.bfloat16)
    make = OPTIMIZERS["adafactor"]
    opt_ref = make(list(ref.parameters()))
    st, opt = layerwise(net, device, make)
    for _ in range(3):
        step_both(ref, opt_ref, net, opt, x)
    want, got = {k: npy(v) for k, v in ref.state_dict().items()}, all_weights(net, st)
    moved = 0
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        moved += int(np.sum(got[k] != npy(stack_pair(16, 4, device, dtype=flame.bfloat16, seed=5)[0].state_dict()[k])))
    assert moved > 100


def test_max_grad_norm_clips_each_blocks_gradients_by_their_own_norm(device):
    ref, net = stack_pair(16, 4, device, seed=7)
    x = 30 * flame.randn(6, 16, device=device)   # gradients far above the bound
    make = OPTIMIZERS["adamw"]
    opt_ref = make(list(ref.parameters()))
    st, opt = layerwise(net, device, make, max_grad_norm=0.05)
    for _ in range(2):
        step_both(ref, opt_ref, net, opt, x, clip=lambda m: block_clipped(m, 0.05))
    want, got = {k: npy(v) for k, v in ref.state_dict().items()}, all_weights(net, st)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=2e-6, err_msg=k)
    # and without the per-block clipping the reference moves elsewhere: the clipping did something
    ref2, _ = stack_pair(16, 4, device, seed=7)
    o2 = make(list(ref2.parameters()))
    for _ in range(2):
        loss_of(ref2, x).backward()
        o2.step()
        o2.zero_grad()
    assert not np.allclose(npy(ref2.blocks[0].fc1.weight), want["blocks.0.fc1.weight"], atol=1e-4)


@pytest.mark.parametrize("norm", [0.0, 0.05])
def test_max_grad_value_clamps_each_blocks_gradients_before_their_norm_clip(device, norm):
    """max_grad_value: every block gradient clamped to [-v, v] (then, with max_grad_norm, clipped by the clamped
    block's norm): the step of the whole model with clip_grad_value_ (and the per-block norm clip) after backward."""
    ref, net = stack_pair(16, 4, device, seed=8)
    x = 30 * flame.randn(6, 16, device=device)
    make = OPTIMIZERS["adamw"]
    opt_ref = make(list(ref.parameters()))
    st, opt = layerwise(net, device, make, max_grad_norm=norm, max_grad_value=1e-3)

    def clip(m):
        nn.utils.clip_grad_value_(m.blocks.parameters(), 1e-3)
        if norm:
            block_clipped(m, norm)
    for _ in range(2):
        step_both(ref, opt_ref, net, opt, x, clip=clip)
    want, got = {k: npy(v) for k, v in ref.state_dict().items()}, all_weights(net, st)
    for k in want:
        if k.startswith("blocks."):
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=2e-6, err_msg=k)


def test_paused_drops_the_blocks_gradients_and_leaves_the_weights(device):
    _, net = stack_pair(16, 3, device, seed=2)
    st, opt = layerwise(net, device, OPTIMIZERS["adafactor"])
    before = all_weights(net, st)
    x = flame.randn(4, 16, device=device)
    with opt.paused():
        loss_of(net, x).backward()
    assert all(p.grad is None for p in net.blocks.parameters())
    assert opt.block_steps == 0 and opt.grads_finite() is None
    assert all(np.array_equal(v, before[k]) for k, v in all_weights(net, st).items() if k.startswith("blocks."))
    assert net.inp.weight.grad is not None   # the rest keeps its gradients for step()
    opt.zero_grad()


def test_non_finite_block_gradients_are_flagged(device):
    _, net = stack_pair(16, 3, device, seed=2)
    st, opt = layerwise(net, device, OPTIMIZERS["adafactor"])
    x = flame.randn(4, 16, device=device)
    loss_of(net, x).backward()
    assert bool(opt.grads_finite().item())
    x = x.clone()
    x[0, 0] = float("nan")
    loss_of(net, x).backward()
    assert not bool(opt.grads_finite().item())


def test_state_dict_resumes_the_run_exactly(device):
    ref, net = stack_pair(16, 4, device, seed=4)
    x = flame.randn(5, 16, device=device)
    make = OPTIMIZERS["adafactor"]
    st_ref, opt_ref = layerwise(ref, device, make)
    for _ in range(4):
        loss_of(ref, x).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    st, opt = layerwise(net, device, make)
    for _ in range(2):
        loss_of(net, x).backward()
        opt.step()
        opt.zero_grad()
    saved, weights = opt.state_dict(), all_weights(net, st)
    _, again = stack_pair(16, 4, device, seed=0)   # other weights: everything comes from the saves
    again.load_state_dict({k: flame.tensor(v, device=device) for k, v in weights.items()})
    st2, opt2 = layerwise(again, device, make)
    opt2.load_state_dict(saved)
    for _ in range(2):
        loss_of(again, x).backward()
        opt2.step()
        opt2.zero_grad()
    want, got = all_weights(ref, st_ref), all_weights(again, st2)
    for k in want:   # (on cuda Adafactor's fused sums add in an order of their own)
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=2e-6, err_msg=k)


def test_coupled_optimizers_and_missing_parameters_are_refused(device):
    _, net = stack_pair(16, 2, device)
    st = BlockStreamer(net.blocks, device=device, stream_trainable=True)
    with pytest.raises(OffloadError, match="Prodigy couples its parameters"):
        LayerwiseOptimizer(st, nn.optim.Prodigy(list(net.parameters())))
    with pytest.raises(OffloadError, match=r"block 0\.0: trainable .* not among the optimizer's parameters"):
        LayerwiseOptimizer(st, nn.optim.Adafactor(list(net.inp.parameters()), lr=1e-3, relative_step=False))
    with pytest.raises(ValueError, match="max_grad_norm must be >= 0"):
        LayerwiseOptimizer(st, nn.optim.Adafactor(list(net.parameters()), lr=1e-3, relative_step=False),
                           max_grad_norm=-1)
    with pytest.raises(ValueError, match="max_grad_value must be None or > 0"):
        LayerwiseOptimizer(st, nn.optim.Adafactor(list(net.parameters()), lr=1e-3, relative_step=False),
                           max_grad_value=0)
    frozen = stack_pair(16, 2, device)[1]
    frozen.blocks.requires_grad_(False)
    with pytest.raises(OffloadError, match="stream_trainable"):
        LayerwiseOptimizer(BlockStreamer(frozen.blocks, device=device), nn.optim.AdamW(frozen.parameters()))


def test_a_layerwise_streamer_is_not_captured(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs are a cuda feature")
    _, net = stack_pair(16, 2, device)
    st, opt = layerwise(net, device, OPTIMIZERS["adafactor"])
    x = flame.randn(4, 16, device=device)
    fn = flame.cuda.graphed(lambda x: loss_of(net, x).backward(), warmup=0)
    with pytest.raises(OffloadError, match="layer-wise optimizer cannot be captured"):
        fn(x)


def test_on_host_reads_and_writes_the_trained_weights_as_cpu_tensors(device):
    ref, net = stack_pair(16, 4, device, seed=8)
    x = flame.randn(5, 16, device=device)
    st, opt = layerwise(net, device, OPTIMIZERS["adafactor"], resident=(2,))
    loss_of(net, x).backward()
    opt.step()
    opt.zero_grad()
    want = all_weights(net, st)
    with st.on_host():
        got = {k: npy(v).copy() for k, v in net.state_dict().items()}
        assert net.blocks[0].fc1.weight.device.type == "cpu" and net.blocks[2].fc1.weight.device.type == "cpu"
        with flame.no_grad():   # a resume's write: into the host copies, streamed and resident blocks alike
            net.blocks[0].fc1.weight.copy_(flame.zeros(32, 16))
            net.blocks[2].fc2.bias.copy_(flame.ones(16))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    after = all_weights(net, st)
    assert np.all(after["blocks.0.fc1.weight"] == 0) and np.all(after["blocks.2.fc2.bias"] == 1)
    # the forward reads the written weights: block 2 is resident (its buffer filled again), block 0 streams
    ref.load_state_dict({k: flame.tensor(v, device=device) for k, v in after.items()})
    with flame.no_grad():
        np.testing.assert_allclose(npy(net(x)), npy(ref(x)), rtol=1e-6, atol=1e-6)
    loss_of(net, x).backward()   # and training goes on
    opt.step()
    assert opt.block_steps == 8


def test_one_blocks_gradients_exist_at_a_time(device):
    """Each block's trainable tensors have lazy gradient buffers of their own, released after its update: when a
    block's backward ends, no other block holds gradient storage (the whole model's gradients never exist)."""
    from flame_core import grad_pool
    _, net = stack_pair(16, 5, device, seed=1)
    st, opt = layerwise(net, device, OPTIMIZERS["adafactor"])
    buffers = [{id(grad_pool.buffer_of(p)): grad_pool.buffer_of(p) for p in b.parameters()} for b in net.blocks]
    assert all(not set(a) & set(b) for i, a in enumerate(buffers) for b in buffers[i + 1:])   # none shared
    seen, real = [], opt._after_backward

    def spy(i):
        seen.append((i, [k for k, bufs in enumerate(buffers) if any(b.resident for b in bufs.values())]))
        real(i)
    opt._after_backward = spy
    loss_of(net, flame.randn(4, 16, device=device)).backward()
    assert seen == [(i, [i]) for i in range(4, -1, -1)]
    assert not any(b.resident for bufs in buffers for b in bufs.values())


def test_a_resident_blocks_update_reaches_its_host_copy_when_read_or_demoted(device):
    """A resident block computes from its own buffer, updated in place: its host copy is written only when read
    (state_dict, on_host) or when the block is demoted to streaming -- and then holds the update."""
    ref, net = stack_pair(16, 3, device, seed=6)
    x = flame.randn(4, 16, device=device)
    make = OPTIMIZERS["adafactor"]
    opt_ref = make(list(ref.parameters()))
    st, opt = layerwise(net, device, make, resident=(0, 1, 2))
    for _ in range(2):
        step_both(ref, opt_ref, net, opt, x)
        assert st._stale == {0, 1, 2}   # nothing copied back per step
        st.set_resident([1])            # two demoted: the updates go to the host before their buffers go
        assert st._stale == set()
        st.set_resident([0, 1, 2])
    want = {k: npy(v) for k, v in ref.state_dict().items()}
    got = all_weights(net, st)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=2e-6, err_msg=k)


@pytest.mark.parametrize("name", ["adafactor", "adamw8bit", "lion"])
def test_each_blocks_kernel_table_is_built_once(device, name):
    """The fused kernels' table of a block's parameters (addresses of the parameters and their states: a streamed
    block's in its home slot every step) is built on the first step and reused after, for every block -- more
    blocks than an optimizer's default table cache holds."""
    if device.type != "cuda":
        pytest.skip("the fused optimizer kernels (and their tables) are a cuda path")
    from flame_nn.optim import multi_tensor as MT
    _, net = stack_pair(16, 12, device, seed=2)
    st, opt = layerwise(net, device, OPTIMIZERS[name], resident=(0, 5))
    x = flame.randn(4, 16, device=device)
    built = []
    for _ in range(3):
        loss_of(net, x).backward()
        opt.step()
        opt.zero_grad()
        cache = opt.optimizer._plans if name == "adamw8bit" else opt.optimizer._tables.tables
        built.append({id(t[1] if name == "adamw8bit" else t) for t in cache.values()})
    assert len(built[0]) >= 12 and built[0] == built[1] == built[2]
    assert opt.optimizer._tables.keep >= 2 * 12 + 8 > MT.Tables().keep
