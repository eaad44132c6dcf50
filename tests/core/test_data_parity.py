"""flame_core.utils.data's WeightedRandomSampler, DistributedSampler, StackDataset and ChainDataset: PyTorch's rules
and errors; DistributedSampler's unshuffled index lists against PyTorch's (tests/fixtures/torch_nn/data_sched.json,
made by tests/fixtures/make_data_sched_fixtures.py); shuffled orders and weighted draws (FLAME's random streams, not
PyTorch's) by their statistics with fixed seeds."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
import flame_core.distributed as dist
from flame_core.distributed import TCPStore
from flame_core.utils.data import (
    ChainDataset,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    StackDataset,
    WeightedRandomSampler,
    get_worker_info,
)

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "data_sched.json")


def _gen(seed=0):
    return flame.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- WeightedRandomSampler
def test_weighted_sampler_with_replacement_follows_the_weights():
    weights = [0.1, 0.9, 0.0, 2.0, 1.0]  # need not sum to 1
    draws = list(WeightedRandomSampler(weights, 40000, generator=_gen(0)))
    assert len(draws) == 40000 and 2 not in draws  # a zero weight is never drawn
    freq = np.bincount(draws, minlength=5) / 40000
    p = np.array(weights) / sum(weights)
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(p * (1 - p) / 40000).max())
    assert list(WeightedRandomSampler(weights, 50, generator=_gen(3))) == \
        list(WeightedRandomSampler(weights, 50, generator=_gen(3)))  # the seed decides the draws
    s = WeightedRandomSampler(weights, 50, generator=_gen(3))
    assert list(s) != list(s) and len(s) == 50  # each epoch draws anew
    flame.manual_seed(7)
    a = list(WeightedRandomSampler(weights, 30))
    flame.manual_seed(7)
    assert list(WeightedRandomSampler(weights, 30)) == a  # no generator: flame's default generator
    w = WeightedRandomSampler(flame.tensor([1.0, 3.0]), 4)
    assert w.weights.dtype == flame.float64 and w.weights.tolist() == [1.0, 3.0]


def test_weighted_sampler_without_replacement():
    weights = [1.0, 2.0, 0.0, 4.0, 8.0]
    for seed in range(5):
        got = list(WeightedRandomSampler(weights, 4, replacement=False, generator=_gen(seed)))
        assert sorted(got) == [0, 1, 3, 4]  # each non-zero index once, the zero one never
    first = [next(iter(WeightedRandomSampler(weights, 2, replacement=False, generator=_gen(s)))) for s in range(3000)]
    np.testing.assert_allclose(np.bincount(first, minlength=5) / 3000, np.array(weights) / 15, atol=0.03)
    with pytest.raises(ValueError, match="without replacement"):
        list(WeightedRandomSampler(weights, 5, replacement=False))


@pytest.mark.parametrize("args, kwargs, match", [
    (([1.0, 2.0], 0), {}, "num_samples should be a positive integer value, but got num_samples=0"),
    (([1.0, 2.0], True), {}, "num_samples should be a positive integer value, but got num_samples=True"),
    (([1.0, 2.0], 2.0), {}, "num_samples should be a positive integer value"),
    (([1.0, 2.0], 3), {"replacement": "x"}, "replacement should be a boolean value, but got replacement=x"),
    (([[1.0, 2.0]], 2), {}, r"weights should be a 1d sequence but given weights have shape \(1, 2\)"),
])
def test_weighted_sampler_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightedRandomSampler(*args, **kwargs)


def test_weighted_sampler_refuses_negative_weights_when_drawing():
    with pytest.raises(ValueError, match="element < 0"):
        list(WeightedRandomSampler([1.0, -1.0, 2.0], 2))


# ----------------------------------------------------------------------------- DistributedSampler
def test_distributed_sampler_matches_pytorch_unshuffled():
    with open(FIX) as f:
        cases = json.load(f)["distributed"]
    for c in cases:
        for rank, want in enumerate(c["ranks"]):
            s = DistributedSampler(range(c["n"]), num_replicas=c["num_replicas"], rank=rank, shuffle=False,
                                   drop_last=c["drop_last"])
            assert list(s) == want and len(s) == len(want), c
            s.set_epoch(3)
            assert list(s) == want  # the epoch only moves a shuffled order


def _ranks(n, replicas, **kw):
    return [list(DistributedSampler(range(n), num_replicas=replicas, rank=r, **kw)) for r in range(replicas)]


def _epoch(n, replicas, epoch, **kw):
    out = []
    for r in range(replicas):
        s = DistributedSampler(range(n), num_replicas=replicas, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def test_distributed_sampler_shuffled():
    n, replicas = 23, 4
    parts = _epoch(n, replicas, 0, seed=5)
    assert [len(p) for p in parts] == [6] * 4
    flat = sum(parts, [])
    assert set(flat) == set(range(n)) and len(flat) == 24  # every index, one repeated to pad
    # the ranks share one permutation: interleaving them back gives it, padded with its first index
    perm = [parts[i % replicas][i // replicas] for i in range(24)]
    assert sorted(perm[:n]) == list(range(n)) and perm[n] == perm[0] and perm[:n] != list(range(n))
    assert _epoch(n, replicas, 0, seed=5) == parts  # the same seed and epoch repeat
    assert _epoch(n, replicas, 1, seed=5) != parts  # another epoch, another order
    assert _epoch(n, replicas, 0, seed=6) != parts
    assert _epoch(n, replicas, 1, seed=4) == _epoch(n, replicas, 0, seed=5)  # seed + epoch decides
    dropped = _epoch(n, replicas, 2, seed=5, drop_last=True)
    flat = sum(dropped, [])
    assert [len(p) for p in dropped] == [5] * 4 and len(set(flat)) == 20 and set(flat) <= set(range(n))
    # over many epochs every index comes up in about its share of first places
    firsts = [_epoch(8, 2, e)[0][0] for e in range(800)]
    assert np.bincount(firsts, minlength=8).min() > 60


def test_distributed_sampler_in_a_loader():
    parts = [[b.tolist() for b in DataLoader(range(10), batch_size=2, sampler=DistributedSampler(
        range(10), num_replicas=3, rank=r, shuffle=False))] for r in range(3)]
    assert parts == [[[0, 3], [6, 9]], [[1, 4], [7, 0]], [[2, 5], [8, 1]]]


def test_distributed_sampler_needs_the_group_or_its_arguments(monkeypatch):
    assert not dist.is_initialized()
    for kw in ({}, {"num_replicas": 2}, {"rank": 0}):
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            DistributedSampler(range(5), **kw)
    with pytest.raises(ValueError, match=r"Invalid rank 2, rank should be in the interval \[0, 1\]"):
        DistributedSampler(range(5), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"Invalid rank -1"):
        DistributedSampler(range(5), num_replicas=2, rank=-1)
    store = TCPStore("localhost", 0, 1, is_master=True, timeout=5)
    dist.init_process_group("store", store=store, rank=0, world_size=1)
    try:
        s = DistributedSampler(range(5), shuffle=False)
        assert (s.num_replicas, s.rank, list(s)) == (1, 0, [0, 1, 2, 3, 4])
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
        s = DistributedSampler(range(5), shuffle=False)
        assert (s.num_replicas, s.rank, list(s)) == (3, 2, [2, 0])
        assert DistributedSampler(range(5), rank=0, shuffle=False).num_replicas == 3
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- StackDataset
class Batched(Dataset):
    """i * 10; counts its batched fetches."""

    def __init__(self, n):
        self.n, self.batched = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i * 10

    def __getitems__(self, indices):
        self.batched += 1
        return [i * 10 for i in indices]


def test_stack_dataset_tuple_and_dict():
    letters, tens = list("abcde"), Batched(5)
    t = StackDataset(letters, tens)
    assert len(t) == 5 and t[1] == ("b", 10) and t.datasets == (letters, tens)
    assert t.__getitems__([4, 0]) == [("e", 40), ("a", 0)] and tens.batched == 1
    d = StackDataset(x=letters, y=tens)
    assert len(d) == 5 and d[2] == {"x": "c", "y": 20}
    assert d.__getitems__([3, 1]) == [{"x": "d", "y": 30}, {"x": "b", "y": 10}] and tens.batched == 2
    batches = list(DataLoader(StackDataset(x=flame.arange(6), y=Batched(6)), batch_size=4))
    assert [b["x"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5]]
    assert [b["y"].tolist() for b in batches] == [[0, 10, 20, 30], [40, 50]]


class Short(Batched):
    def __getitems__(self, indices):
        return [0]


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "At least one dataset should be passed"),
    (([1, 2],), {"b": [1, 2]}, "but both types are given"),
    (([1, 2], [1, 2, 3]), {}, "Size mismatch between datasets"),
    ((), {"a": [1], "b": []}, "Size mismatch between datasets"),
])
def test_stack_dataset_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StackDataset(*args, **kwargs)


def test_stack_dataset_checks_a_parts_batch_size():
    with pytest.raises(ValueError, match="Nested dataset's output size mismatch. Expected 2, got 1"):
        StackDataset([1, 2, 3], Short(3)).__getitems__([0, 1])


# ----------------------------------------------------------------------------- ChainDataset
class Stream(IterableDataset):
    """start .. stop - 1, each worker taking every num_workers-th value."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop

    def __len__(self):
        return self.stop - self.start

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(self.start + first, self.stop, step))


def test_chain_dataset():
    chain = ChainDataset([Stream(0, 3), Stream(10, 12)])
    assert list(chain) == [0, 1, 2, 10, 11] and list(chain) == [0, 1, 2, 10, 11] and len(chain) == 5
    plus = Stream(0, 2) + Stream(5, 6)
    assert isinstance(plus, ChainDataset) and list(plus) == [0, 1, 5]
    assert [b.tolist() for b in DataLoader(chain, batch_size=2)] == [[0, 1], [2, 10], [11]]
    assert len(DataLoader(chain, batch_size=2)) == 3
    got = [b.tolist() for b in DataLoader(chain, batch_size=2, num_workers=2)]
    assert sorted(sum(got, [])) == [0, 1, 2, 10, 11]  # each worker chains its share of each stream


def test_chain_dataset_takes_iterable_datasets_only():
    chain = ChainDataset([Stream(0, 2), [5, 6]])
    with pytest.raises(AssertionError, match="ChainDataset only supports IterableDataset, got a list"):
        list(chain)
    with pytest.raises(AssertionError, match="ChainDataset only supports IterableDataset"):
        len(chain)
