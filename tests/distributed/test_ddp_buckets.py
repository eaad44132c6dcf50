"""DistributedDataParallel's bucketing and readiness logic in one process: a fake two-rank group records every
collective (with a copy of what it would send) instead of sending it. The numbers across real processes are
checked by test_ddp_processes.py."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core import grad_pool
from flame_core.checkpoint import checkpoint
from flame_core.distributed.base import Backend, CompletedWork
from flame_nn import adapters as A
from flame_nn.parallel import DDPError, DistributedDataParallel
from flame_nn.parallel.buckets import plan_buckets


class RecordingBackend(Backend):
    name = "store"

    def __init__(self, peer_signature=None):
        self.calls, self.peer_signature = [], peer_signature

    def all_reduce(self, arr, op):
        self.calls.append(("all_reduce", arr, arr.copy(), op))
        return CompletedWork()

    def broadcast(self, arr, src):
        self.calls.append(("broadcast", arr, None, src))
        return CompletedWork()

    def all_gather(self, out, inp):
        n = inp.size
        out[:n] = inp
        out[n:] = inp if self.peer_signature is None else self.peer_signature
        return CompletedWork()

    def wait_all(self):
        pass


class FakeGroup:
    """Rank 0 of 2 on the cpu; nothing leaves the process."""
    backend_name = "store"

    def __init__(self, peer_signature=None):
        self.backend = RecordingBackend(peer_signature)
        self.device = flame.device("cpu")

    def rank(self):
        return 0

    def size(self):
        return 2

    def reduces(self):
        return [c for c in self.backend.calls if c[0] == "all_reduce"]


def _params(*numels, dtype=flame.float32):
    ps = [flame.zeros(n, dtype=dtype, requires_grad=True) for n in numels]
    grad_pool.register(ps)
    return ps


def _ranges(buckets, params):
    return [sorted(b.params) for b in buckets], [(b.start, b.end) for b in buckets]


def test_buckets_follow_reverse_order_caps_and_contiguity():
    ps = _params(100, 300, 50, 700, 10)  # bytes 400, 1200, 200, 2800, 40; slots padded to 64 elements
    buckets = plan_buckets(ps, cap_bytes=2000, first_cap_bytes=500)
    members, _ = _ranges(buckets, ps)
    assert members == [[4], [3], [0, 1, 2]]  # the first bucket small, an oversized parameter alone
    for b in buckets:
        assert b.nbytes <= (500 if b.index == 0 else 2000) or len(b.params) == 1
        for i in b.params:
            off, n = grad_pool.slice_of(ps[i])
            assert b.start <= off and off + n <= b.end
        assert b.view.numel() == b.end - b.start
    covered = sorted(i for b in buckets for i in b.params)
    assert covered == [0, 1, 2, 3, 4]


def test_a_foreign_parameter_in_the_same_flat_buffer_splits_the_bucket():
    a, foreign, b = _params(8, 8, 8)
    buckets = plan_buckets([a, b], cap_bytes=1 << 20)
    assert [bk.params for bk in buckets] == [[1], [0]]
    off_f, n_f = grad_pool.slice_of(foreign)
    for bk in buckets:
        assert bk.end <= off_f or bk.start >= off_f + n_f  # never inside a bucket


def test_each_dtype_has_its_own_buckets():
    f32 = _params(8, 8)
    f64 = _params(8, dtype=flame.float64)
    buckets = plan_buckets([f32[0], f64[0], f32[1]], cap_bytes=1 << 20)
    assert [sorted(b.params) for b in buckets] == [[0, 2], [1]]
    assert {b.flat.dtype for b in buckets} == {flame.float32, flame.float64}


class Net(nn.Module):
    """inp -> block (checkpointed, used twice: its parameters get two accumulations per backward) -> out."""

    def __init__(self):
        super().__init__()
        flame.manual_seed(0)
        self.inp, self.fc, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def block(self, h):
        return h + self.fc(h).tanh()

    def forward(self, x, twice=True):
        h = checkpoint(self.block, self.inp(x).tanh())
        if twice:
            h = checkpoint(self.block, h)
        return self.out(h)


def _backward(model, seed=1, **kw):
    x = flame.tensor(np.random.default_rng(seed).standard_normal((5, 4)).astype(np.float32))
    model(x, **kw).pow(2).mean().backward()


def _final(ddp, b):
    return b.view.numpy().copy()


def test_learning_pass_then_buckets_launch_in_order_once_each_with_final_gradients():
    g = FakeGroup()
    model = Net()
    ddp = DistributedDataParallel(model, process_group=g, bucket_cap_mb=64 / 2 ** 20)  # 64-byte buckets
    assert [c[0] for c in g.backend.calls] == ["broadcast"] * 6  # every trainable parameter, from rank 0
    n = len(ddp.buckets)
    assert n >= 4
    _backward(ddp)
    first = g.reduces()
    assert [c[1] is b.view._data for c, b in zip(first, ddp.buckets)] == [True] * n  # all at the end, in order
    assert ddp.expected == [1, 1, 2, 2, 1, 1]  # inp.w, inp.b, fc.w, fc.b (two regions), out.w, out.b
    assert ddp.stats == {"synced_passes": 1, "buckets_overlapped": 0, "buckets_at_end": n}
    for c, b in zip(first, ddp.buckets):
        np.testing.assert_array_equal(c[2], _final(ddp, b))
    ddp.module.zero_grad()
    g.backend.calls.clear()
    _backward(ddp, seed=2)
    second = g.reduces()
    assert [next(i for i, b in enumerate(ddp.buckets) if c[1] is b.view._data) for c in second] == list(range(n))
    for c, b in zip(second, ddp.buckets):  # what was sent is what the bucket finally holds: no early launch
        np.testing.assert_array_equal(c[2], _final(ddp, b))
        assert c[3].name == "AVG"
    assert ddp.stats["buckets_overlapped"] == n and ddp.stats["buckets_at_end"] == n  # all but none at the end


def test_no_sync_accumulates_locally_then_one_pass_averages_the_sum():
    g = FakeGroup()
    model = Net()
    ddp = DistributedDataParallel(model, process_group=g)
    with ddp.no_sync():
        _backward(ddp, seed=1)
        _backward(ddp, seed=2)
    assert g.reduces() == []
    _backward(ddp, seed=3)
    sent = np.concatenate([c[2] for c in g.reduces()])
    ref = Net()
    for s in (1, 2, 3):
        _backward(ref, seed=s)
    want = np.concatenate([p.grad.numpy().ravel() for p in ref.parameters()])
    got = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.count_nonzero(sent) == np.count_nonzero(want)  # the accumulated gradients went out (once each)


def test_all_reduce_gradients_outside_backward():
    g = FakeGroup()
    ddp = DistributedDataParallel(Net(), process_group=g)
    with ddp.no_sync():
        _backward(ddp)
    ddp.all_reduce_gradients()
    assert len(g.reduces()) == len(ddp.buckets)


def test_more_gradients_after_the_bucket_left_is_an_error_naming_the_parameter():
    g = FakeGroup()
    model = Net()
    ddp = DistributedDataParallel(model, process_group=g, bucket_cap_mb=64 / 2 ** 20)
    _backward(ddp, twice=False)  # learns one accumulation for fc
    ddp.module.zero_grad()
    with pytest.raises(DDPError, match=r"fc\.(weight|bias) received gradient number 2 .* after its bucket"):
        _backward(ddp, twice=True)


def test_a_parameter_unused_this_time_is_reduced_at_the_end_and_gets_a_grad():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, use_b=True):
            return self.b(self.a(x)) if use_b else self.a(x)
    g = FakeGroup()
    m = Two()
    ddp = DistributedDataParallel(m, process_group=g)
    x = flame.ones(2, 3)
    ddp(x).sum().backward()
    m.zero_grad(set_to_none=True)
    g.backend.calls.clear()
    ddp(x, use_b=False).sum().backward()
    assert len(g.reduces()) == len(ddp.buckets)
    assert m.b.weight.grad is grad_pool.pooled_grad(m.b.weight)  # the average will sit there: every rank steps it
    np.testing.assert_array_equal(m.b.weight.grad.numpy(), np.zeros((3, 3)))


def test_a_replaced_grad_is_refused():
    g = FakeGroup()
    m = nn.Linear(3, 3)
    ddp = DistributedDataParallel(m, process_group=g)
    m.weight.grad = flame.zeros(3, 3)  # not the pooled view: the engine accumulates there, outside the buffer
    with pytest.raises(DDPError, match="weight: its .grad is not the pooled gradient"):
        ddp(flame.ones(1, 3)).sum().backward()


def test_other_parameters_on_another_rank_are_refused_before_any_bucket():
    with pytest.raises(DDPError, match=r"ranks \[1\] hold other trainable parameters"):
        DistributedDataParallel(nn.Linear(3, 3), process_group=FakeGroup(peer_signature=np.array([2, 12345])))


def test_adapters_are_passed_explicitly():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.requires_grad_(False)
    A.inject_adapters(model, ["0", "1"], "lora", rank=2, alpha=2)
    with pytest.raises(DDPError, match="named_adapter_parameters"):
        DistributedDataParallel(model, process_group=FakeGroup())
    g = FakeGroup()
    ddp = DistributedDataParallel(model, process_group=g, parameters=A.named_adapter_parameters(model))
    assert ddp.params == A.adapter_parameters(model)
    ddp(flame.ones(3, 4)).sum().backward()
    assert len(g.reduces()) == len(ddp.buckets) and ddp.expected == [1] * len(ddp.params)


def test_construction_checks():
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        DistributedDataParallel(nn.Linear(2, 2), process_group=FakeGroup(), bucket_cap_mb=0)
    with pytest.raises(DDPError, match=r"device_ids=\[1\] but the parameters are on cpu"):
        DistributedDataParallel(nn.Linear(2, 2), process_group=FakeGroup(), device_ids=[1])
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(DDPError, match="no parameter that requires grad"):
        DistributedDataParallel(frozen, process_group=FakeGroup())


def test_forward_broadcasts_buffers_from_rank_0():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scale", flame.ones(2))

        def forward(self, x):
            return self.lin(x) * self.scale
    g = FakeGroup()
    ddp = DistributedDataParallel(WithBuffer(), process_group=g)
    n0 = len(g.backend.calls)  # 2 parameters + 1 buffer
    ddp(flame.ones(1, 2))
    assert n0 == 3 and [c[0] for c in g.backend.calls[n0:]] == ["broadcast"]
    g2 = FakeGroup()
    DistributedDataParallel(WithBuffer(), process_group=g2, broadcast_buffers=False)(flame.ones(1, 2))
    assert len(g2.backend.calls) == 2
