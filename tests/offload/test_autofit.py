"""auto_fit: measures a step, keeps as many blocks resident as the budget allows, enforces the budget, and fails
early with the minimum in the message."""
import pytest
from offload_helpers import Stack, assert_same, npy, stack_pair

import flame_core as flame
import flame_core.memory as M
import flame_nn as nn
from flame_nn.offload import BlockStreamer, MemoryBudgetError, auto_fit
from flame_nn.offload.autofit import fmt_bytes

D, N = 256, 8  # blocks of ~1 MiB (fp32), activations of a few hundred KiB


def exact_accounting(device):
    """These tests count bytes exactly, as the cpu accounting does; the cuda pool reserves ~1 MiB blocks in 20 MiB
    segments (test_gpu_streaming.py has the cuda version with blocks of exactly-sized segments)."""
    if device.type == "cuda":
        pytest.skip("exact byte counts need the cpu accounting; see test_gpu_streaming.py for cuda")


@pytest.fixture
def setup(device):
    ref, net = stack_pair(D, N, device)
    for m in (ref, net):
        m.blocks.requires_grad_(False)
    for b in net.blocks:  # resident blocks checkpointed like streamed ones: a resident block costs its weights only
        b.gradient_checkpointing = True
    st = BlockStreamer(net.blocks, device=device)
    x = flame.randn(64, D, device=device)
    calls = [0]

    def step():
        calls[0] += 1
        y = net(x)
        (y * y).mean().backward()
        net.zero_grad()
        del y
    return ref, net, st, x, step, calls


def test_budget_below_the_minimum_fails_with_the_minimum_in_the_message(setup, device):
    exact_accounting(device)
    _, _, st, _, step, _ = setup
    big = auto_fit(st, "64GiB", step, headroom=0, count_driver_overhead=False, enforce=False)
    assert big.minimum > big.static > 0
    budget = big.minimum - 4096
    with pytest.raises(MemoryBudgetError) as e:
        auto_fit(st, budget, step, headroom=0, count_driver_overhead=False, offload_activations=False)
    assert e.value.minimum == big.minimum
    msg = str(e.value)
    assert f"below the minimum of {fmt_bytes(big.minimum)}" in msg
    assert "streaming slots" in msg and "activations" in msg and "fp8" in msg
    assert M.get_memory_limit(device) is None  # a failed fit leaves no limit behind


def test_a_budget_below_what_is_held_fails_before_any_step(setup):
    _, _, st, _, step, calls = setup
    with pytest.raises(MemoryBudgetError, match="before a step runs") as e:
        auto_fit(st, "256KiB", step, headroom=0, count_driver_overhead=False)
    assert calls[0] == 0
    assert e.value.minimum > 256 * 1024


def test_auto_fit_keeps_as_many_blocks_resident_as_fit_and_the_peak_stays_under_the_budget(setup, device):
    exact_accounting(device)
    ref, net, st, x, step, _ = setup
    with flame.no_grad():
        want = npy(ref(x))
    big = auto_fit(st, "64GiB", step, headroom=0, count_driver_overhead=False, enforce=False)
    block = st.block_bytes(0)
    budget = big.minimum + int(3.5 * block)
    rep = st.auto_fit(budget, step, headroom=0, count_driver_overhead=False)
    assert len(rep.resident) == 3 and len(rep.streamed) == N - 3  # three more blocks fit beside the minimum
    assert rep.resident == [0, 1, 2]  # equal sizes: the first ones
    assert rep.measured_peak <= budget
    assert M.get_memory_limit(device) == budget  # enforced from now on
    M.reset_peak_memory_stats(device)
    for _ in range(3):
        y = net(x)
        (y * y).mean().backward()
        net.zero_grad()
        assert_same(npy(y), want, device)
        del y
    assert M.max_memory_allocated(device) <= budget
    assert "3 blocks resident" in str(rep)
    # every block keeps its pinned host copy (a resident one can be demoted): the least host RAM of the run
    assert rep.host_pinned_bytes == st.host_pinned_bytes == sum(st.block_bytes(i) for i in range(N))
    assert rep.host_mapped_bytes == 0
    assert f"host memory: {fmt_bytes(rep.host_pinned_bytes)} pinned" in str(rep) and "memory-mapped" not in str(rep)


def test_verification_demotes_blocks_whose_activations_do_not_fit(setup, device):
    exact_accounting(device)
    _, net, st, _, _, _ = setup
    x = flame.randn(512, D, device=device)  # a batch whose activations outweigh a block's weights

    def step():
        y = net(x)
        (y * y).mean().backward()
        net.zero_grad()
    big = auto_fit(st, "64GiB", step, headroom=0, count_driver_overhead=False, enforce=False)
    for b in net.blocks:
        b.gradient_checkpointing = False  # resident blocks now keep their activations: more than their weights
    budget = big.minimum + int(3.5 * st.block_bytes(0))
    rep = auto_fit(st, budget, step, headroom=0, count_driver_overhead=False)
    assert rep.demoted >= 1 and 1 <= len(rep.resident) < 3
    assert rep.measured_peak <= budget


def test_a_large_budget_makes_every_block_resident_and_drops_the_slots(setup, device):
    _, _, st, x, step, _ = setup
    rep = auto_fit(st, "64GiB", step, headroom=0, count_driver_overhead=False, enforce=False)
    assert rep.resident == list(range(N)) and rep.streamed == [] and st.slot_bytes == 0
    assert rep.num_slots == 0
    assert M.get_memory_limit(device) is None


class Wide(nn.Module):
    def __init__(self, d, h, device):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h, device=device), nn.Linear(h, d, device=device)

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu())


def test_slot_shrinking_is_accounted_when_the_largest_block_becomes_resident(device):
    exact_accounting(device)
    # one big block among small ones: making it resident also shrinks both slots to the small size
    flame.manual_seed(0)
    net = Stack(64, 4, device)
    net.blocks[2] = Wide(64, 192, device)  # 1.5x the others (hidden 128)
    net.blocks.requires_grad_(False)
    st = BlockStreamer(net.blocks, device=device)
    x = flame.randn(8, 64, device=device)

    def step():
        y = net(x)
        (y * y).mean().backward()
        net.zero_grad()
    big, small = st.block_bytes(2), st.block_bytes(0)
    assert 1.4 * small < big < 1.6 * small
    st.set_resident([])
    base = auto_fit(st, "64GiB", step, headroom=0, count_driver_overhead=False, enforce=False)
    # room for the big block only because the slots shrink by 2 * (big - small) when it leaves them
    budget = base.minimum + big - 2 * (big - small) + 1024
    assert budget < base.minimum + small
    rep = auto_fit(st, budget, step, headroom=0, count_driver_overhead=False)
    assert rep.resident == [2] and st.slot_bytes == small
    assert rep.measured_peak <= budget
