"""Collectives on the "store" backend, N ranks as threads of this process (each with its own group over one TCP
store): every reduction, dtype and form against NumPy, async handles, barriers, and the errors."""
import threading

import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
import flame_core.distributed as dist
from flame_core.distributed import ProcessGroup, ReduceOp, TCPStore
from flame_core.errors import DTypeError, ShapeError


def run_ranks(n, fn, timeout=5.0):
    """fn(group, rank) on n threads, each a rank of one store group; returns their results in rank order."""
    master = TCPStore("localhost", 0, n, is_master=True, timeout=timeout)
    results, errors = [None] * n, []

    def body(r):
        store = master if r == 0 else TCPStore("localhost", master.port, n, timeout=timeout)
        g = ProcessGroup(store, r, n, "store", timeout=timeout)
        try:
            results[r] = fn(g, r)
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append((r, e))
        finally:
            g.close(wait_for_others=False)
            if r:
                store.close()
    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    master.close()
    if errors:
        raise errors[0][1]
    return results


def data(r, shape=(5,), dtype=np.float32):
    return (np.random.default_rng(r).standard_normal(shape) * 3).astype(dtype)


@pytest.mark.parametrize("op,ref", [(ReduceOp.SUM, np.sum), (ReduceOp.AVG, np.mean), (ReduceOp.MAX, np.max),
                                    (ReduceOp.MIN, np.min), (ReduceOp.PRODUCT, np.prod)])
def test_all_reduce_every_op_matches_numpy_and_is_identical_on_every_rank(op, ref):
    n = 3

    def fn(g, r):
        t = flame.tensor(data(r, (2, 3)))
        v0 = t._version[0]
        dist.all_reduce(t, op=op, group=g)
        assert t._version[0] == v0 + 1
        return t.numpy()
    got = run_ranks(n, fn)
    want = ref(np.stack([data(r, (2, 3)).astype(np.float64) for r in range(n)]), axis=0)
    for r in range(n):
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)
        assert got[r].tobytes() == got[0].tobytes()


@pytest.mark.parametrize("dtype", [np.float64, ml_dtypes.bfloat16, np.int64, np.int32])
def test_all_reduce_dtypes(dtype):
    def fn(g, r):
        t = flame.tensor(np.arange(4).astype(dtype) * (r + 1))
        dist.all_reduce(t, group=g)
        return t.numpy()
    for got in run_ranks(2, fn):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(np.float64), np.arange(4) * 3)


def test_broadcast_from_each_source():
    def fn(g, r):
        out = []
        for src in range(3):
            t = flame.tensor(np.full(3, 10 * r + 1, dtype=np.int64))
            dist.broadcast(t, src=src, group=g)
            out.append(t.numpy())
        return out
    for got in run_ranks(3, fn):
        assert [int(a[0]) for a in got] == [1, 11, 21]


def test_all_gather_list_and_into_tensor_forms():
    def fn(g, r):
        x = flame.tensor(data(r, (2, 2)))
        lst = [flame.zeros(2, 2) for _ in range(3)]
        dist.all_gather(lst, x, group=g)
        out = flame.zeros(6, 2)
        dist.all_gather_into_tensor(out, x, group=g)
        return [t.numpy() for t in lst], out.numpy()
    for lst, out in run_ranks(3, fn):
        for r in range(3):
            np.testing.assert_array_equal(lst[r], data(r, (2, 2)))
        np.testing.assert_array_equal(out, np.concatenate([data(r, (2, 2)) for r in range(3)]))


def test_reduce_scatter_list_and_tensor_forms():
    n = 3

    def inputs(r):
        return [data(10 * r + j, (2,)) for j in range(n)]

    def fn(g, r):
        a, b = flame.zeros(2), flame.zeros(2)
        dist.reduce_scatter(a, [flame.tensor(x) for x in inputs(r)], op=ReduceOp.SUM, group=g)
        dist.reduce_scatter_tensor(b, flame.tensor(np.concatenate(inputs(r))), op=ReduceOp.MAX, group=g)
        return a.numpy(), b.numpy()
    got = run_ranks(n, fn)
    for r in range(n):
        np.testing.assert_allclose(got[r][0], sum(inputs(j)[r].astype(np.float64) for j in range(n)), rtol=1e-6)
        np.testing.assert_array_equal(got[r][1], np.max([inputs(j)[r] for j in range(n)], axis=0))


def test_async_collectives_complete_in_order_and_wait_orders_the_caller():
    def fn(g, r):
        ts = [flame.full((1000,), float(r + k)) for k in range(5)]
        works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
        works[-1].wait()
        assert all(w.is_completed() for w in works)  # one worker, in the order issued
        for w in works:
            w.wait()
        return [float(t.numpy()[0]) for t in ts]
    for got in run_ranks(2, fn):
        assert got == [1 + 2 * k for k in range(5)]


def test_barrier_names_the_rank_that_did_not_come():
    def fn(g, r):
        if r == 0:
            with pytest.raises(dist.DistributedError, match=r"rank\(s\) \[1\] of 2 did not arrive within 0.3 s"):
                g.barrier(timeout=0.3)
        return r
    assert run_ranks(2, fn) == [0, 1]


def test_barrier_holds_until_all_arrive():
    import time
    arrived = []

    def fn(g, r):
        if r == 1:
            time.sleep(0.3)
        arrived.append(r)
        g.barrier()
        return len(arrived)
    assert run_ranks(3, fn) == [3, 3, 3]


def test_mistakes_are_refused_with_the_reason():
    def fn(g, r):
        with pytest.raises(ValueError, match="must be contiguous"):
            dist.all_reduce(flame.zeros(4, 4).transpose(0, 1), group=g)
        with pytest.raises(DTypeError, match="AVG needs a floating-point"):
            dist.all_reduce(flame.zeros(3, dtype=flame.int64), op=ReduceOp.AVG, group=g)
        with pytest.raises(DTypeError, match="cannot reduce a tensor of dtype bool"):
            dist.all_reduce(flame.zeros(3, dtype=flame.bool), group=g)
        with pytest.raises(ValueError, match="op must be a ReduceOp"):
            dist.all_reduce(flame.zeros(3), op="sum", group=g)
        with pytest.raises(ValueError, match="tensor_list has 1 tensors, the group 2 ranks"):
            dist.all_gather([flame.zeros(2)], flame.zeros(2), group=g)
        with pytest.raises(ShapeError, match="element 1 has shape"):
            dist.all_gather([flame.zeros(2), flame.zeros(3)], flame.zeros(2), group=g)
        with pytest.raises(ShapeError, match="output must hold world_size"):
            dist.all_gather_into_tensor(flame.zeros(3), flame.zeros(2), group=g)
        with pytest.raises(dist.DistributedError, match="src 5 is not a rank"):
            dist.broadcast(flame.zeros(2), src=5, group=g)
        with pytest.raises(TypeError, match="expected a flame Tensor"):
            dist.all_reduce(np.zeros(2), group=g)
        return True
    assert run_ranks(2, fn) == [True, True]


def test_default_group_lifecycle_and_its_errors(monkeypatch):
    assert not dist.is_initialized()
    with pytest.raises(dist.DistributedError, match="has not been initialized"):
        dist.get_rank()
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        dist.init_process_group("gloo", rank=0, world_size=1)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(dist.DistributedError, match="not a TCP port"):
        dist.init_process_group("store", rank=0, world_size=1)
    store = TCPStore("localhost", 0, 1, is_master=True, timeout=5)
    g = dist.init_process_group("store", store=store, rank=0, world_size=1)
    try:
        assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
        assert dist.default_group() is g and dist.get_backend() == "store"
        with pytest.raises(dist.DistributedError, match="already initialized"):
            dist.init_process_group("store", store=store, rank=0, world_size=1)
        t = flame.ones(3)
        dist.all_reduce(t)
        np.testing.assert_array_equal(t.numpy(), [1, 1, 1])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.skipif(flame.cuda_is_available(), reason="checks the message on a machine without a GPU")
def test_nccl_without_a_gpu_says_what_is_missing():
    with pytest.raises(dist.DistributedError, match="backend 'nccl' needs (CuPy|a CUDA GPU).*backend='store'"):
        dist.init_process_group("nccl", rank=0, world_size=1)
    assert not dist.is_nccl_available()


# ----------------------------------------------------------------------------- the NCCL unique id's form
class _Comm:
    def __init__(self, takes):
        self.takes = takes

    def __call__(self, world, uid, rank):   # NcclCommunicator(ndev, commId, rank)
        if self.takes == "bytes" and not isinstance(uid, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes, got tuple)")
        if self.takes != "bytes":
            if not isinstance(uid, tuple):
                raise TypeError("expected tuple")
            lo = -128 if self.takes == "signed" else 0
            if any(not lo <= b < lo + 256 for b in uid):
                raise OverflowError("value too large to convert to char")
        return (world, uid, rank)


@pytest.mark.parametrize("takes", ["bytes", "signed", "unsigned"])
def test_the_nccl_unique_id_reaches_each_cupys_communicator_in_its_form(takes, monkeypatch):
    # CuPy 14 takes the id as bytes; older CuPy as a tuple of C chars (signed on x86)
    import platform
    import types

    from flame_core.distributed.nccl import NCCLBackend
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    raw = bytes(range(120, 248))
    fake = types.SimpleNamespace(nccl=types.SimpleNamespace(NcclCommunicator=_Comm(takes)))
    world, uid, rank = NCCLBackend._communicator(fake, 2, raw, 1)
    assert (world, rank) == (2, 1)
    if takes == "bytes":
        assert uid == raw
    else:
        assert bytes(b % 256 for b in uid) == raw
