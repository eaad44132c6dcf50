"""DevicePool logic (size classes, reuse, split/coalesce, streams, limit, OOM report) under a fake device backend."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flame_core.errors import OutOfMemoryError
from flame_core.memory.pool import HUGE, LARGE, MEDIUM, SMALL, DevicePool, GiB, KiB, MiB, round_size

from .fake_backend import FakeBackend


def make(capacity=1 << 40, **kw):
    be = FakeBackend(capacity)
    return DevicePool(be, name="fake:0", **kw), be


@pytest.mark.parametrize("n, rounded, kind", [
    (1, 512, SMALL), (512, 512, SMALL), (513, 1024, SMALL), (MiB - 1, MiB, SMALL),
    (MiB, MiB, MEDIUM), (MiB + 1, MiB + 64 * KiB, MEDIUM), (10 * MiB - 1, 10 * MiB, MEDIUM),
    (10 * MiB, 10 * MiB, LARGE), (10 * MiB + 1, 10 * MiB + 512, LARGE), (GiB - 2 * MiB - 1, GiB - 2 * MiB, LARGE),
    (GiB - 1, GiB, HUGE), (GiB + 1, GiB + 2 * MiB, HUGE),
])
def test_round_size_classes(n, rounded, kind):
    assert round_size(n) == (rounded, kind)


def test_small_blocks_are_carved_from_one_2mib_segment():
    pool, be = make()
    ptrs = [pool.malloc(3000) for _ in range(100)]  # 100 blocks of 3072 B = 300 KiB
    assert be.mallocs == 1 and list(be.live.values()) == [2 * MiB]
    seg = next(iter(be.live))
    assert sorted(ptrs) == [seg + 3072 * i for i in range(100)]
    assert pool.allocated == 100 * 3072 and pool.requested == 100 * 3000 and pool.reserved == 2 * MiB


def test_segment_sizes_per_class():
    pool, be = make()
    pool.malloc(2 * MiB)  # medium: 20 MiB segment
    pool.malloc(33 * MiB)  # large: a segment of exactly 34 MiB
    pool.malloc(GiB + 5)  # huge: its own segment, rounded to 2 MiB
    assert sorted(be.live.values()) == [20 * MiB, 34 * MiB, GiB + 2 * MiB]


def test_freed_block_is_reused_without_device_malloc():
    pool, be = make()
    p = pool.malloc(64 * MiB)
    pool.free(p)
    assert pool.allocated == 0 and pool.reserved == 64 * MiB
    q = pool.malloc(64 * MiB - 100)  # same rounded size
    assert q == p and be.mallocs == 1
    assert (pool.cache_hits, pool.cache_misses) == (1, 1)


def test_large_blocks_are_the_request_rounded_to_512_bytes():
    """As torch's allocator: a 27 MiB activation carved from a freed larger block holds 27 MiB, not 28; a block is
    split only when more than 1 MiB would be left, so a new 28 MiB segment is all one block."""
    pool, be = make()
    n = 4608 * 3072 * 2  # Flux's joint tokens, bf16: 27 MiB
    big = pool.malloc(190 * MiB)
    pool.free(big)
    a = pool.malloc(n + 1)
    assert a == big and pool.allocated == n + 512 and be.mallocs == 1  # carved: the rest stays free
    b = pool.malloc(192 * MiB)  # a new segment
    assert list(be.live.values()) == [190 * MiB, 192 * MiB] and pool.allocated == n + 512 + 192 * MiB
    pool.free(b)
    c = pool.malloc(n)  # best fit: what the first segment has left (163 MiB), no device call
    assert c == big + n + 512 and be.mallocs == 2 and pool.allocated == 2 * n + 512
    pool.free(a)
    pool.free(c)
    assert pool.allocated == 0 and pool.empty_cache() == 382 * MiB  # the pieces merged back into whole segments
    d = pool.malloc(n + 1)  # an empty cache: a new segment of 28 MiB; a tail of 1 MiB - 512 B is not split off
    assert list(be.live.values()) == [28 * MiB] and pool.allocated == pool.reserved == 28 * MiB
    pool.free(d)
    e = pool.malloc(n - 3 * MiB)  # 24 MiB from the free 28 MiB block: the 4 MiB tail is split off
    assert e == d and pool.allocated == n - 3 * MiB and be.mallocs == 3


def test_split_then_lazy_coalesce_serves_a_larger_request_from_the_same_segment():
    pool, be = make()
    big = pool.malloc(40 * MiB)
    pool.free(big)
    a = pool.malloc(12 * MiB)  # best fit: split the free 40 MiB block
    b = pool.malloc(12 * MiB)  # from the 28 MiB remainder
    assert (a, b) == (big, big + 12 * MiB) and pool.num_splits == 2 and be.mallocs == 1
    pool.free(a)
    pool.free(b)  # free blocks 12, 12, 16 MiB, adjacent: not merged yet (lazy)
    assert pool.num_merges == 0
    c = pool.malloc(40 * MiB)  # no free block >= 40 MiB: coalesce, then reuse
    assert c == big and pool.num_merges == 2 and be.mallocs == 1


def test_huge_blocks_are_never_split():
    pool, be = make()
    h = pool.malloc(2 * GiB)
    pool.free(h)
    pool.malloc(GiB)  # a different huge size: its own segment
    assert be.mallocs == 2 and pool.num_splits == 0


def test_streams_have_separate_free_lists():
    pool, be = make()
    p = pool.malloc(64 * MiB)
    pool.free(p)
    be.stream = 7
    q = pool.malloc(64 * MiB)
    assert q != p and be.mallocs == 2
    be.stream = 0
    assert pool.malloc(64 * MiB) == p


def test_limit_releases_cache_then_raises_readable_oom_and_pool_stays_usable():
    pool, be = make()
    pool.set_limit(64 * MiB)
    pool.free(pool.malloc(40 * MiB))  # 40 MiB cached
    big = pool.malloc(50 * MiB)  # 40 + 50 > 64: cached segment released first, then it fits
    assert (pool.num_device_free, pool.num_alloc_retries, pool.reserved) == (1, 1, 50 * MiB)
    pool.tag(big, ((25, 1024, 1024), "float16", "train.py:12 in step"))
    with pytest.raises(OutOfMemoryError) as ei:
        pool.malloc(20 * MiB)
    msg = str(ei.value)
    for part in ("tried to allocate 20.00 MiB", "allocated 50.00 MiB", "reserved 50.00 MiB", "limit 64.00 MiB",
                 "(25, 1024, 1024) float16", "train.py:12 in step"):
        assert part in msg, (part, msg)
    assert pool.num_ooms == 1 and pool.allocated == 50 * MiB
    small = pool.malloc(10 * MiB)  # still usable: 60 MiB <= 64 MiB
    pool.free(small)
    pool.set_limit(None)
    pool.malloc(100 * MiB)


def test_small_request_under_tight_limit_gets_an_exact_segment():
    pool, be = make()
    pool.set_limit(MiB)  # a 2 MiB small segment would not fit
    pool.malloc(4000)
    assert list(be.live.values()) == [4096] and pool.reserved == 4096


def test_device_refusal_releases_cache_and_retries():
    pool, be = make(capacity=30 * MiB)
    pool.free(pool.malloc(20 * MiB))
    p = pool.malloc(24 * MiB)  # device has 10 MiB free: release the cached 20 MiB, retry
    assert p in be.live and be.frees == 1 and pool.num_alloc_retries == 1
    with pytest.raises(OutOfMemoryError, match="device: 6.00 MiB free of 30.00 MiB"):
        pool.malloc(24 * MiB)


def test_empty_cache_releases_only_wholly_free_segments():
    pool, be = make()
    a = pool.malloc(4096)
    b = pool.malloc(4096)  # same small segment as a
    m = pool.malloc(3 * MiB)  # medium segment
    pool.free(b)
    pool.free(m)
    released = pool.empty_cache()
    assert released == 20 * MiB and pool.reserved == 2 * MiB and be.frees == 1
    pool.free(a)
    assert pool.empty_cache() == 2 * MiB and pool.reserved == 0 and not be.live


def test_free_arriving_during_malloc_is_deferred_and_applied():
    pool, be = make()
    victim = pool.malloc(64 * MiB)
    real_malloc = be.malloc

    def malloc_with_gc(nbytes):  # as if the cyclic GC freed an array in the middle of malloc
        pool.free(victim)
        return real_malloc(nbytes)

    be.malloc = malloc_with_gc
    p = pool.malloc(16 * MiB)
    assert pool.allocated == 16 * MiB and pool.num_free == 1 and victim not in pool._live
    be.malloc = real_malloc
    assert pool.malloc(64 * MiB) == victim and p != victim


def test_stats_counts():
    pool, be = make()
    ps = [pool.malloc(1000) for _ in range(5)]
    for p in ps:
        pool.free(p)
    ps = [pool.malloc(1000) for _ in range(5)]
    assert (pool.num_alloc, pool.num_free, pool.cache_hits, pool.cache_misses) == (10, 5, 5, 5)
    assert pool.num_device_alloc == 1 and pool.peak_allocated == 5 * 1024
    pool.reset_peak()
    assert pool.peak_allocated == 5 * 1024
    for p in ps:
        pool.free(p)
    pool.reset_peak()
    assert pool.peak_allocated == 0


def _check_invariants(pool, be, live):
    segs = pool.segments()
    assert sum(seg.size for seg, _ in segs) == pool.reserved == sum(be.live.values())
    for seg, blocks in segs:
        end = seg.ptr
        for b in blocks:  # blocks tile their segment exactly, in address order
            assert b.ptr == end
            end += b.size
        assert end == seg.ptr + seg.size
    live_blocks = {b.ptr: b for _, bl in segs for b in bl if not b.free}
    assert set(live_blocks) == set(live)
    for ptr, (n, r) in live.items():  # a large block keeps a tail of at most 1 MiB (torch's rule)
        assert r >= n and r <= live_blocks[ptr].size <= r + (MiB if round_size(n)[1] == LARGE else 0)
    assert pool.allocated == sum(live_blocks[p].size for p in live)
    for sub_list in pool._streams.values():
        for sub in sub_list:
            for size, lst in sub.free.items():
                for b in lst:
                    assert b.free and b.size == size and b.sub is sub


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 48 * MiB), st.integers(0, 1 << 30), st.integers(0, 1)),
                min_size=1, max_size=60),
       st.booleans())
def test_random_sequences_keep_the_pool_consistent(ops, limited):
    pool, be = make(capacity=512 * MiB)
    if limited:
        pool.set_limit(160 * MiB)
    live = {}
    for do_alloc, n, pick, stream in ops:
        be.stream = stream
        if do_alloc or not live:
            try:
                p = pool.malloc(n)
            except OutOfMemoryError:  # only when even an exact-size segment cannot be had after releasing the cache
                r = round_size(n)[0]
                assert (limited and pool.reserved + r > 160 * MiB) or be.used + r > be.capacity
                continue
            assert p not in live
            live[p] = (n, round_size(n)[0])
        else:
            p = sorted(live)[pick % len(live)]
            del live[p]
            pool.free(p)
        if limited:
            assert pool.reserved <= 160 * MiB
        _check_invariants(pool, be, live)
    for p in list(live):
        pool.free(p)
    pool.empty_cache()
    assert pool.reserved == 0 and pool.allocated == 0 and not be.live


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 48 * MiB), st.integers(0, 1 << 30), st.booleans()),
                min_size=1, max_size=60))
def test_random_sequences_with_a_capture_stream_under_the_limit(ops):
    # stream 9 is pinned (a graph being captured): under the limit it borrows free blocks from stream 0's cache
    pool, be = make(capacity=512 * MiB)
    pool.set_limit(160 * MiB)
    pool.pin_stream(9)
    live = {}
    for do_alloc, n, pick, capture in ops:
        be.stream = 9 if capture else 0
        if do_alloc or not live:
            try:
                p = pool.malloc(n)
            except OutOfMemoryError:
                assert pool.reserved + round_size(n)[0] > 160 * MiB
                continue
            live[p] = (n, round_size(n)[0])
        else:
            p = sorted(live)[pick % len(live)]
            del live[p]
            pool.free(p)
        assert pool.reserved <= 160 * MiB
        _check_invariants(pool, be, live)
    pool.unpin_stream(9)
    pool.release_stream(9)
    _check_invariants(pool, be, live)
    for p in list(live):
        pool.free(p)
    pool.empty_cache()
    assert pool.reserved == 0 and pool.allocated == 0 and not be.live


def test_capture_stream_adopts_free_blocks_of_the_eager_cache_under_the_limit():
    pool, be = make(capacity=1 << 40)
    x = pool.malloc(128 * MiB)                     # stream 0: one 128 MiB segment
    pool.free(x)
    y = pool.malloc(64 * MiB)                      # its first half; the second half stays free in stream 0's cache
    assert y == x
    pool.set_limit(160 * MiB)
    assert pool.empty_cache() == 0                 # the segment is half live: it cannot go back
    pool.pin_stream(9)
    be.stream = 9                                  # a capture: 64 MiB more would pass the limit
    z = pool.malloc(64 * MiB)
    assert z == x + 64 * MiB and pool.reserved == 128 * MiB and pool.num_adopted == 1
    pool.free(z)                                   # back to the graph's free list, not stream 0's
    assert pool.malloc(64 * MiB) == z and pool.num_adopted == 1
    pool.free(z)
    be.stream = 0
    with pytest.raises(OutOfMemoryError):          # the graph owns it now; eager work cannot take it back
        pool.malloc(64 * MiB)
    pool.free(y)
    assert pool.empty_cache() == 0                 # the owner never releases a segment with a lent block
    pool.unpin_stream(9)
    pool.release_stream(9)                         # the graph is gone: the block returns to its owner
    assert pool.empty_cache() == 128 * MiB and pool.reserved == 0 and not be.live


def test_pinned_stream_blocks_survive_empty_cache_and_oom_retry():
    # a CUDA graph's capture stream: its blocks are the addresses the graph replays into
    pool, be = make(capacity=200 * MiB)
    be.stream = 9
    p = pool.malloc(64 * MiB)
    pool.pin_stream(9)
    pool.free(p)                                   # freed into the graph's free list
    be.stream = 0
    q = pool.malloc(64 * MiB)
    pool.free(q)
    assert pool.empty_cache() == 64 * MiB          # only the eager segment goes back
    assert be.frees == 1 and pool.reserved == 64 * MiB
    with pytest.raises(OutOfMemoryError):          # the retry may not take the graph's memory either
        pool.malloc(150 * MiB)
    assert pool.reserved == 64 * MiB
    pool.pin_stream(9)
    pool.unpin_stream(9)                           # counted: still pinned once
    assert pool.empty_cache() == 0
    pool.unpin_stream(9)
    assert pool.empty_cache() == 64 * MiB and be.used == 0


def test_release_stream_gives_back_only_that_streams_cache():
    pool, be = make()
    be.stream = 5
    p = pool.malloc(64 * MiB)
    pool.free(p)
    be.stream = 0
    q = pool.malloc(64 * MiB)
    pool.free(q)
    pool.pin_stream(5)
    assert pool.release_stream(5) == 0          # pinned: a live graph still replays into it
    pool.unpin_stream(5)
    assert pool.release_stream(5) == 64 * MiB and be.frees == 1
    assert pool.malloc(64 * MiB) == q           # the default stream's cache is still there
