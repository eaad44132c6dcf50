"""Caching device allocator: size classes, per-stream free lists, split on demand, lazy coalescing, a limit.

The pool knows nothing about CUDA: a backend object gives it raw memory (`malloc(nbytes) -> int address`,
`free(ptr, nbytes)`, `current_stream()` -> an object whose `.ptr` keys the free lists: CuPy's get_current_stream
itself on a GPU, so the hot path runs no Python frame for it), so the same logic runs under a fake backend in CPU
tests and under `flame_core.memory.cuda.CudaBackend` (cudaMalloc / cudaFree) on a GPU.

Size classes (request -> rounded block size, where the block comes from):
  small   request <  1 MiB   512 B steps          carved from 2 MiB segments
  medium  1 MiB .. < 10 MiB  64 KiB steps         carved from 20 MiB segments
  large   >= 10 MiB          512 B steps          carved from a free block, else from a new segment of the request
                                                  rounded to 2 MiB (the tail stays free in the class's cache)
  huge    2 MiB-rounded      2 MiB steps          allocated directly: its own segment, reused only by a request
          >= 1 GiB                                of the same rounded size, never split
A large block is the request rounded to 512 B, split off a larger free block only when more than 1 MiB would be
left (a smaller tail could serve no large request): torch's caching allocator's rule, so that `allocated` means the
same in both. A 27 MiB activation (Flux's 4608 x 3072 bf16 tokens) carved out of a freed 189 MiB one holds 27 MiB,
not 28; one that gets a 28 MiB block or segment holds all of it.
Fragmentation: blocks are split on demand (best fit within the class) and adjacent free blocks are coalesced
lazily -- when a request finds no free block large enough and a free has left neighbours free ("dirty"), and
before any segment is released -- not on every free. In a training loop the same sizes recur each step, so the
steady state is exact free-list hits (one dict lookup and a list pop) with no splitting or merging.

Free lists are per stream (the stream current at allocation): a block freed by the host while kernels on its
stream may still use it is only handed to later work on that same stream, which runs after them.

CUDA graphs: a capture stream is pinned (`pin_stream`): its blocks stay reserved while the graph lives. When a
capture's request would go over the limit, it adopts a free block of another (unpinned) stream's cache instead of
failing: the capture began after a device synchronisation and its work replays in stream order after everything
queued before it, so nothing still reads the block; from then on the block belongs to the graph (its segment stays
with its owner, which never merges or releases a block it lent). Without this, the free pieces of segments that
eager tensors still occupy are out of a capture's reach, and a graphed step needs more memory than the same step run
eagerly. When the stream is unpinned (the graph dropped), the lent blocks go back to their owners as they become free.

Limit: `limit` caps reserved bytes (what the pool holds from the device). A request that would need a segment
beyond the limit (or that the device refuses) first releases every cached segment of the device, retries, and
only then raises `OutOfMemoryError` with a report of what holds memory; the pool stays usable.
"""
import bisect
import threading

from ..errors import OutOfMemoryError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SMALL_MAX, SMALL_STEP, SMALL_SEGMENT = 1 * MiB, 512, 2 * MiB
MEDIUM_MAX, MEDIUM_STEP, MEDIUM_SEGMENT = 10 * MiB, 64 * KiB, 20 * MiB
LARGE_STEP = 2 * MiB
HUGE_MIN = 1 * GiB
SMALL, MEDIUM, LARGE, HUGE = 0, 1, 2, 3
KIND_NAMES = ("small", "medium", "large", "huge")


class DeviceOutOfMemory(Exception):
    """Raised by a backend when the device refuses an allocation."""


def round_size(nbytes, huge_min=HUGE_MIN):
    """(rounded block size, size class) of a request of `nbytes` bytes (a large block may hold up to 1 MiB more)."""
    if nbytes < SMALL_MAX:
        return max(SMALL_STEP, (nbytes + SMALL_STEP - 1) & -SMALL_STEP), SMALL
    if nbytes < MEDIUM_MAX:
        return (nbytes + MEDIUM_STEP - 1) & -MEDIUM_STEP, MEDIUM
    r = (nbytes + LARGE_STEP - 1) & -LARGE_STEP
    return (r, HUGE) if r >= huge_min else ((nbytes + SMALL_STEP - 1) & -SMALL_STEP, LARGE)


class Block:
    """A piece of a segment: live (handed out) or free (in its sub-pool's free list)."""
    __slots__ = ("ptr", "size", "requested", "seg", "sub", "prev", "next", "free", "tag")

    def __init__(self, ptr, size, seg, sub):
        self.ptr, self.size, self.seg, self.sub = ptr, size, seg, sub
        self.requested = 0
        self.prev = self.next = None
        self.free = True
        self.tag = None  # (shape, dtype, origin) of a tensor on it: set at birth, or on demand (DevicePool.tagger)


class Segment:
    """One backend allocation; its blocks form an address-ordered linked list starting at `head`. `owner` is the
    sub-pool that holds it (blocks lent to a capture stream's sub-pool keep their segment's owner)."""
    __slots__ = ("ptr", "size", "head", "owner")

    def __init__(self, ptr, size, owner=None):
        self.ptr, self.size, self.head, self.owner = ptr, size, None, owner


class _SubPool:
    """Free blocks of one size class on one stream: size -> [blocks], plus the sorted sizes for best fit."""
    __slots__ = ("kind", "stream", "free", "sizes", "dirty", "segments", "lent")

    def __init__(self, kind, stream):
        self.kind, self.stream = kind, stream
        self.free = {}
        self.sizes = []  # sorted keys of `free` (a key may map to an empty list until a search drops it)
        self.dirty = False  # some free block has a free neighbour
        # dicts used as insertion-ordered sets: the free lists a coalesce rebuilds come out in the same order every
        # run (a set of segments iterates in address-of-object order, which made the layout differ run to run)
        self.segments = {}
        self.lent = {}  # other sub-pools' segments holding blocks lent to this one (a capture's adoptions)


class DevicePool:
    """Caching allocator for one device. `malloc(nbytes) -> ptr`, `free(ptr)`; stats as attributes."""

    def __init__(self, backend, name="device", huge_min=HUGE_MIN):
        self.backend = backend
        self.name = name
        self.huge_min = huge_min
        self.limit = None
        self._observer = None  # profiler callback(event, pool, block), None when no profiler is active (observer)
        self.on_observer_change = None  # called () after the observer is set or removed (memory.cuda: birth tags)
        self.tagger = None  # called () before tags are read (live_items): tags the blocks of live tensors on demand
        # called () with the lock held before blocks are listed or cached memory released (settle): gives back blocks
        # held above the pool, counted as free there (memory.recycle's bin of small dead arrays)
        self.reclaim = None
        self._streams = {}  # stream key -> [small, medium, large, huge] sub-pools
        self._live = {}  # ptr -> Block
        self._lock = threading.Lock()
        self._pending = []  # frees that arrived while the lock was held (GC inside malloc, other threads)
        self._current_stream = backend.current_stream  # the hot path reads `current_stream().ptr` once per malloc
        self._pinned_streams = {}  # stream key -> count: free lists a CUDA graph owns (never released, see pin_stream)
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = 0
        self.num_free = self.cache_hits = self.cache_misses = 0  # num_alloc = hits + misses (a property)
        self.num_splits = self.num_merges = self.num_device_alloc = self.num_device_free = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.num_adopted = 0  # blocks lent to a CUDA graph's capture from another stream's cache under the limit
        self.bytes_freed_total = 0  # bytes_allocated_total is derived (a property): one update fewer per malloc

    # ------------------------------------------------------------------ hot path
    def malloc(self, nbytes):
        if nbytes < SMALL_MAX:
            r = (nbytes + 511) & -512 or 512
            kind = 0
        elif nbytes < MEDIUM_MAX:
            r = (nbytes + 65535) & -65536
            kind = 1
        else:
            r = (nbytes + LARGE_STEP - 1) & -LARGE_STEP
            if r >= self.huge_min:
                kind = 3
            else:
                r = (nbytes + 511) & -512
                kind = 2
        stream = self._current_stream().ptr
        lock = self._lock
        lock.acquire()
        try:
            subs = self._streams.get(stream)
            if subs is None:
                subs = self._streams[stream] = [_SubPool(k, stream) for k in range(4)]
            sub = subs[kind]
            lst = sub.free.get(r)
            if lst:
                blk = lst.pop()
                self.cache_hits += 1
            else:
                blk = self._miss(sub, r, nbytes)
                self.cache_misses += 1
            blk.free = False
            blk.requested = nbytes
            self._live[blk.ptr] = blk
            self.requested += nbytes
            a = self.allocated = self.allocated + blk.size  # r, or up to 1 MiB more for a large block (_fit)
            if a > self.peak_allocated:
                self.peak_allocated = a
            if self._pending:  # frees deferred while the lock was held (GC inside this malloc)
                self._drain()
        finally:
            lock.release()
        if self._observer is not None:
            self._observer("alloc", self, blk)
        return blk.ptr

    @property
    def observer(self):
        return self._observer

    @observer.setter
    def observer(self, fn):
        if fn is not None and self._observer is None and self.reclaim is not None:
            self.settle()  # the bin's arrays (memory.recycle) die before a watcher starts: their frees are not its
        self._observer = fn
        if self.on_observer_change is not None:
            self.on_observer_change()

    @property
    def num_alloc(self):
        return self.cache_hits + self.cache_misses

    @property
    def bytes_allocated_total(self):
        # every block handed out is either live (`allocated`, its rounded size) or freed since (`bytes_freed_total`)
        return self.allocated + self.bytes_freed_total

    def free(self, ptr):
        lock = self._lock
        if not lock.acquire(False):  # re-entered from GC inside malloc, or another thread: defer
            self._pending.append(ptr)
            return
        try:
            blk = self._free_locked(ptr)
            if self._pending:
                self._drain()
        finally:
            lock.release()
        if self._observer is not None and blk is not None:
            self._observer("free", self, blk)

    def _free_locked(self, ptr):
        blk = self._live.pop(ptr, None)
        if blk is None:
            return None
        blk.free = True
        blk.tag = None
        size = blk.size
        self.allocated -= size
        self.requested -= blk.requested
        self.bytes_freed_total += size
        self.num_free += 1
        sub = blk.sub
        lst = sub.free.get(size)
        if lst is None:
            sub.free[size] = [blk]
            bisect.insort(sub.sizes, size)
        else:
            lst.append(blk)
        if not sub.dirty:
            p, n = blk.prev, blk.next
            if (p is not None and p.free) or (n is not None and n.free):
                sub.dirty = True
        return blk

    def _drain(self):
        while self._pending:
            blk = self._free_locked(self._pending.pop())
            if self._observer is not None and blk is not None:
                self._observer("free", self, blk)

    # ------------------------------------------------------------------ misses
    def _miss(self, sub, r, nbytes):
        blk = None
        if sub.kind != HUGE:
            blk = self._best_fit(sub, r)
            if blk is None and sub.dirty:
                self._coalesce(sub)
                blk = self._best_fit(sub, r)
        if blk is None:
            blk = self._new_segment(sub, r, nbytes)
        self._fit(blk, r)
        return blk

    def _fit(self, blk, r):
        """Cut free block `blk` down to `r` bytes; a large block keeps a tail of 1 MiB or less (torch's rule)."""
        if blk.size > r and (blk.sub.kind != LARGE or blk.size - r > SMALL_MAX):
            self._split(blk, r)

    @staticmethod
    def _best_fit(sub, r):
        sizes, free = sub.sizes, sub.free
        i = bisect.bisect_left(sizes, r)
        while i < len(sizes):
            s = sizes[i]
            lst = free[s]
            if lst:
                return lst.pop()
            del sizes[i]
            del free[s]
        return None

    def _split(self, blk, r):
        rest = Block(blk.ptr + r, blk.size - r, blk.seg, blk.sub)
        rest.prev, rest.next = blk, blk.next
        if blk.next is not None:
            blk.next.prev = rest
        blk.next = rest
        blk.size = r
        self.num_splits += 1
        self._push(blk.sub, rest)
        if rest.next is not None and rest.next.free:
            blk.sub.dirty = True

    @staticmethod
    def _push(sub, blk):
        lst = sub.free.get(blk.size)
        if lst is None:
            sub.free[blk.size] = [blk]
            bisect.insort(sub.sizes, blk.size)
        else:
            lst.append(blk)

    def _coalesce(self, sub, release=False):
        """Merge runs of adjacent free blocks of `sub`; with `release`, give wholly free segments back to the backend
        and blocks lent to `sub` by other sub-pools back to their owners. Rebuilds the sub-pool's free lists.
        Returns the bytes released."""
        released = 0
        free = {}
        for seg in list(sub.segments):
            b = seg.head
            while b is not None:
                if b.free and b.sub is sub:
                    n = b.next
                    while n is not None and n.free and n.sub is sub:
                        b.size += n.size
                        b.next = n.next
                        if n.next is not None:
                            n.next.prev = b
                        self.num_merges += 1
                        n = b.next
                    if release and b is seg.head and b.next is None:
                        self._release_segment(sub, seg)
                        released += seg.size
                    else:
                        free.setdefault(b.size, []).append(b)
                b = b.next
        for seg in list(sub.lent):  # lent blocks: never merged across owners; returned on release
            b, still = seg.head, False
            while b is not None:
                if b.sub is sub:
                    if b.free and release:
                        b.sub = seg.owner
                        self._push(seg.owner, b)
                        seg.owner.dirty = True
                    elif b.free:
                        free.setdefault(b.size, []).append(b)
                    else:
                        still = True
                b = b.next
            if release and not still:
                sub.lent.pop(seg, None)
        sub.free = free
        sub.sizes = sorted(free)
        sub.dirty = False
        return released

    def _adopt(self, sub, r):
        """A capture stream's request that the limit refuses: a free block of at least `r` bytes from an unpinned
        stream's cache of the same class, lent to `sub` (see the module docstring). None when there is none."""
        for key, subs in self._streams.items():
            if key in self._pinned_streams:
                continue
            other = subs[sub.kind]
            blk = self._best_fit(other, r)
            if blk is None and other.dirty:
                self._coalesce(other)
                blk = self._best_fit(other, r)
            if blk is None:
                continue
            self._fit(blk, r)  # the rest stays with its owner
            blk.sub = sub
            sub.lent[blk.seg] = None
            self.num_adopted += 1
            return blk
        return None

    # ------------------------------------------------------------------ segments
    def _new_segment(self, sub, r, nbytes):
        kind = sub.kind
        if kind >= LARGE:  # whole 2 MiB pages, as the device maps them: what `reserved` says is what it holds
            sizes = ((r + LARGE_STEP - 1) & -LARGE_STEP,)
        else:
            sizes = (SMALL_SEGMENT if kind == SMALL else MEDIUM_SEGMENT, r)
        freed_cache = 0
        for attempt in (0, 1):
            for size in sizes:
                if self.limit is not None and self.reserved + size > self.limit:
                    continue
                try:
                    ptr = self.backend.malloc(size)
                except DeviceOutOfMemory:
                    continue
                return self._add_segment(sub, ptr, size)
            if attempt == 0:
                self.num_alloc_retries += 1
                self._settle_locked()
                freed_cache = self._release_cached()
                release_foreign = getattr(self.backend, "release_foreign", None)
                if release_foreign is not None:
                    release_foreign()
                if kind != HUGE:  # merging may have made a large enough free block
                    blk = self._best_fit(sub, r)
                    if blk is None and sub.stream in self._pinned_streams:
                        blk = self._adopt(sub, r)
                    if blk is not None:
                        return blk
        self.num_ooms += 1
        from .stats import oom_message
        raise OutOfMemoryError(oom_message(self, nbytes, r, KIND_NAMES[kind] + " class", freed_cache))

    def _add_segment(self, sub, ptr, size):
        seg = Segment(ptr, size, sub)
        blk = seg.head = Block(ptr, size, seg, sub)
        sub.segments[seg] = None
        self.num_device_alloc += 1
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return blk

    def _release_segment(self, sub, seg):
        sub.segments.pop(seg, None)
        self.backend.free(seg.ptr, seg.size)
        self.num_device_free += 1
        self.reserved -= seg.size

    def _release_cached(self):
        subs = [sub for key, subs in self._streams.items() if key not in self._pinned_streams  # (a CUDA graph
                for sub in subs]                                                   # replays into pinned blocks)
        subs.sort(key=lambda sub: not sub.lent)  # lent blocks go back to their owners before those release
        return sum(self._coalesce(sub, release=True) for sub in subs)

    def pin_stream(self, key):
        """Keep the blocks of stream `key` (a CUDA graph's capture stream) reserved: empty_cache and the OOM retry
        leave them alone, since a graph replays into those addresses. Counted; `unpin_stream` undoes one pin."""
        with self._lock:
            self._settle_locked()  # (nothing binned above the pool is handed to the capture)
            self._pinned_streams[key] = self._pinned_streams.get(key, 0) + 1

    def release_stream(self, key):
        """Give the wholly free segments of stream `key`'s free lists back to the device (a dropped CUDA graph's
        private blocks; other streams' caches stay). Returns the bytes released."""
        with self._lock:
            self._settle_locked()
            if key in self._pinned_streams:
                return 0
            return sum(self._coalesce(sub, release=True) for sub in self._streams.get(key, ()))

    def unpin_stream(self, key):
        with self._lock:
            n = self._pinned_streams.get(key, 0) - 1
            if n > 0:
                self._pinned_streams[key] = n
            else:
                self._pinned_streams.pop(key, None)

    # ------------------------------------------------------------------ maintenance / introspection
    def empty_cache(self):
        """Give every wholly free segment back to the device. Returns the bytes released."""
        with self._lock:
            self._settle_locked()
            return self._release_cached()

    def settle(self, wait=True):
        """Blocks held above the pool (`reclaim`) returned and deferred frees applied: what the pool then lists as
        live is what tensors hold. wait=False: skipped (False) while the lock is held -- by another thread, or by this
        one inside malloc (the out-of-memory report, whose retry has settled already)."""
        lock = self._lock
        if not lock.acquire(wait):
            return False
        try:
            self._settle_locked()
        finally:
            lock.release()
        return True

    def _settle_locked(self):
        if self.reclaim is not None:
            self.reclaim()
        if self._pending:
            self._drain()

    def reset_peak(self):
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def set_limit(self, nbytes):
        """Cap reserved bytes (None: no cap). Lowering the cap below what is reserved releases the cache first."""
        self.limit = None if nbytes is None else int(nbytes)
        if self.limit is not None and self.reserved > self.limit:
            self.empty_cache()

    def tag(self, ptr, tag):
        blk = self._live.get(ptr)
        if blk is not None and blk.tag is None:
            blk.tag = tag
            return blk
        return None

    def live_items(self):
        """[(bytes, shape, dtype, origin)] of live blocks (shape None for buffers no tensor was born on)."""
        if self.reclaim is not None:
            self.settle(wait=False)
        if self.tagger is not None:
            self.tagger()
        out = []
        for blk in list(self._live.values()):
            t = blk.tag
            out.append((blk.size,) + t if t is not None else (blk.size, None, None, None))
        return out

    def live_blocks(self):
        with self._lock:
            self._settle_locked()
            return list(self._live.values())

    def segments(self):
        """[(segment, [blocks in address order])] for every segment of every stream and class."""
        with self._lock:
            self._settle_locked()
            out = []
            for subs in self._streams.values():
                for sub in subs:
                    for seg in sub.segments:
                        blocks, b = [], seg.head
                        while b is not None:
                            blocks.append(b)
                            b = b.next
                        out.append((seg, blocks))
            return out

    def class_bytes(self):
        """{class name: (allocated bytes, reserved bytes)}."""
        if self.reclaim is not None:
            self.settle(wait=False)
        alloc = dict.fromkeys(KIND_NAMES, 0)
        res = dict.fromkeys(KIND_NAMES, 0)
        for subs in self._streams.values():
            for sub in subs:
                name = KIND_NAMES[sub.kind]
                for seg in sub.segments:
                    res[name] += seg.size
        for blk in list(self._live.values()):
            alloc[KIND_NAMES[blk.sub.kind]] += blk.size
        return {k: (alloc[k], res[k]) for k in KIND_NAMES}

    def device_info(self):
        info = getattr(self.backend, "mem_info", None)
        return info() if info is not None else None
