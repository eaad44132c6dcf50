"""Auto-fit: choose which blocks stay on the GPU for a memory budget, by measuring steps.

    report = auto_fit(streamer, "12GiB", step_fn)       # or streamer.auto_fit(...); max_gpu_memory in the trainer

1. Every block is streamed (the least memory a step can take) and the device's cached memory is released. What is
   held now -- the weights outside the blocks, trainable parameters, gradient buffers, the K slots -- is the static
   part; if it alone exceeds the budget the fit fails at once, before any step runs.
2. `step_fn()` runs one step (forward + backward, as training will) with no cap; its peak of the pool's reserved
   bytes, plus `extra_bytes` (state created later, e.g. optimizer moments) plus, on cuda, the driver's memory outside
   the pool (CUDA context, libraries; measured before and after the step, the larger counts: the first step loads
   kernels and cuBLAS workspaces) is the MINIMUM. A budget below minimum + headroom fails with a message that
   states the minimum and what it is made of. When it is over, the plan (flame_nn.offload.plan) turns on what the
   budget needs, in order -- the checkpointed block inputs offloaded to pinned host memory (`offload_activations`;
   the measured step counted their bytes), then, when the blocks are fp8 already, the large weights outside the
   blocks stored in fp8 -- and the step is measured again with them: that measurement is the minimum. A budget that
   fits without them leaves them off (no copies added).
3. The remaining bytes are filled with resident blocks, largest first (each resident byte is a byte not copied twice
   per step); when the largest streamed block becomes resident the slots shrink, which is accounted for. The cache
   is emptied first, so the resident buffers and slots get segments of their own instead of being carved out of
   the measured step's cached activation segments (holes that later activations would have to fit around).
4. The step runs `verify_steps` times (default 3) under a pool limit `margin` below the budget (default half the
   headroom) less `extra_bytes` (not allocated by those steps); if any of them does not fit, blocks are demoted and
   the steps run again. Then the budget itself is set
   as the pool's limit (`flame_core.memory.set_memory_limit`; over it allocations fail instead of growing past it).
   Several steps, because the pool's layout is not the same from one step to the next: a step can fit where a later
   one does not (bench/streaming.py saw fp8 budgets verified by one step fail two steps later, the pool full of
   free pieces too small for a 135 MiB request); the margin leaves room for the drift that is still to come. The
   report gives the measured figures.
"""
import gc
from dataclasses import dataclass, field

from flame_core import backend
from flame_core import memory as M
from flame_core.errors import FlameError, OutOfMemoryError
from flame_core.memory.stats import fmt_bytes, parse_size

from .plan import plan_budget

GiB = 2 ** 30


class MemoryBudgetError(FlameError, ValueError):
    """The memory budget is below what one step needs even with every block streamed; the message states the
    minimum, also in `.minimum` (bytes; a lower bound when the fit stopped before running a step)."""

    def __init__(self, message, minimum=None):
        super().__init__(message)
        self.minimum = minimum


@dataclass
class FitReport:
    budget: int                    # max_gpu_memory in bytes
    overhead: int                  # device memory outside FLAME's pool (cuda context, libraries); 0 on cpu
    minimum: int                   # measured need with every block streamed (pool peak + extra + overhead)
    static: int                    # held before the step with every block streamed (weights outside blocks, slots...)
    resident: list = field(default_factory=list)
    streamed: list = field(default_factory=list)
    resident_bytes: int = 0
    streamed_bytes: int = 0
    slot_bytes: int = 0
    num_slots: int = 0
    measured_peak: int = None      # pool peak (reserved) over the verification steps
    demoted: int = 0               # blocks given back to streaming after a verification step did not fit
    verify_peaks: list = field(default_factory=list)  # pool peak (reserved) of each verification step
    verify_limit: int = None       # the pool limit the verification steps ran under (budget - overhead - margin)
    offload_activations: bool = False  # block inputs carried in pinned host memory between forward and backward
    offloaded_bytes: int = 0       # of them per step (counted by the measured step)
    activation_host_bytes: int = 0  # pinned host memory they take
    host_pinned_bytes: int = 0     # pinned host memory of the blocks' weights (every block's copy) and activations
    host_mapped_bytes: int = 0     # block weights read from memory-mapped files instead (reclaimable page cache)
    outside_fp8: list = field(default_factory=list)  # weights outside the blocks stored in fp8 (names)
    outside_fp8_bytes: int = 0     # device bytes that saved
    plan: object = None            # the BudgetPlan made from the first measured step (before the savers)

    @property
    def pool_budget(self):
        return self.budget - self.overhead

    def __str__(self):
        g = fmt_bytes
        lines = [f"auto-fit for max_gpu_memory {g(self.budget)}: {len(self.resident)} blocks resident "
                 f"({g(self.resident_bytes)}), {len(self.streamed)} streamed ({g(self.streamed_bytes)}) through "
                 f"{self.num_slots} slots of {g(self.slot_bytes)}",
                 f"  minimum (everything streamed) {g(self.minimum)}; static part {g(self.static)}; "
                 f"outside the pool {g(self.overhead)}"]
        if self.measured_peak is not None:
            n = len(self.verify_peaks)
            lines.append(f"  verified {n} step{'s' if n != 1 else ''}: pool peak {g(self.measured_peak)} of "
                         f"{g(self.pool_budget)} allowed"
                         + (f" (verified under {g(self.verify_limit)})" if self.verify_limit is not None
                            and self.verify_limit < self.pool_budget else "")
                         + (f" ({self.demoted} blocks demoted after a try did not fit)" if self.demoted else ""))
        lines.append("  activations: " + (f"block inputs offloaded to pinned host memory ({g(self.offloaded_bytes)} "
                                          f"per step, {g(self.activation_host_bytes)} pinned)"
                                          if self.offload_activations else "kept on the device"))
        lines.append(f"  host memory: {g(self.host_pinned_bytes)} pinned (the least host RAM this run needs: the "
                     f"blocks' weights" + (" and the offloaded activations" if self.offload_activations else "") + ")"
                     + (f", {g(self.host_mapped_bytes)} of weights memory-mapped from their files"
                        if self.host_mapped_bytes else ""))
        if self.outside_fp8:
            lines.append(f"  weights outside the blocks: {len(self.outside_fp8)} Linear weights stored in fp8 "
                         f"({g(self.outside_fp8_bytes)} saved)")
        if self.plan is not None and len(self.plan.steps) > 1:
            lines.append("  planned from the first step: " + "; ".join(f"{w}: {g(m)}" for w, m in self.plan.steps))
        return "\n".join(lines)


def outside_pool(dev):
    """Bytes the device has in use beyond FLAME's pool (CUDA context, cuBLAS, compiled kernels, a CUDA graph's
    executable, other processes...) as the driver reports them; 0 on cpu."""
    if dev.type != "cuda":
        return 0
    cp = backend.cupy
    with dev.context():
        free, total = cp.cuda.runtime.memGetInfo()
    return max(0, (total - free) - M.memory_reserved(dev))


def _rounded(nbytes, dev):
    return M.round_size(nbytes)[0] if (dev.type == "cuda" and nbytes) else nbytes


def _choose(streamer, slack, dev):
    n, K = len(streamer.blocks), streamer.num_slots
    size = [streamer.block_bytes(i) for i in range(n)]
    streamed = set(range(n))
    slot = max(size, default=0)
    chosen = []
    for i in sorted(range(n), key=lambda i: (-size[i], i)):
        rest = streamed - {i}
        new_slot = max((size[j] for j in rest), default=0)
        delta = _rounded(size[i], dev) + K * (_rounded(new_slot, dev) - _rounded(slot, dev))
        if delta <= slack:
            chosen.append(i)
            slack -= delta
            streamed, slot = rest, new_slot
    return sorted(chosen)


def _place(streamer, chosen, dev):
    streamer.set_resident(chosen, fresh=True)


def demote(streamer, fraction=0.25):
    """Stream a `fraction` (at least one) of `streamer`'s resident blocks again, the largest first (they free the
    most per block): what auto_fit does when a verification step does not fit, and what a trainer does when a CUDA
    graph capture of its step does not fit the budget. Returns the demoted indices (empty when none is resident)."""
    chosen = streamer.resident
    if not chosen:
        return []
    drop = max(1, int(len(chosen) * fraction))
    gone = set(sorted(chosen, key=lambda i: (-streamer.block_bytes(i), i))[:drop])
    _place(streamer, [i for i in chosen if i not in gone], streamer.device)  # (drops their kept fp8 W^T too)
    return sorted(gone)


class OutsideGrowth:
    """What fit_outside_growth did: `over` bytes taken off the pool's limit (0: nothing needed), the blocks
    `demoted` in `rounds` calls of demote, or `foreign`: a growth too large to be this process's graph, left
    alone."""

    def __init__(self, outside, over, demoted=(), rounds=0, foreign=False):
        self.outside, self.over, self.demoted, self.rounds, self.foreign = outside, over, list(demoted), rounds, foreign

    def __bool__(self):
        return self.over > 0

    def words(self):
        if self.foreign:
            return (f"{fmt_bytes(self.outside)} in use outside FLAME's pool after the CUDA graph capture, "
                    f"{fmt_bytes(self.over)} past max_gpu_memory: more than this process's graph adds (another "
                    f"process on the device?); the budget cannot be kept from here")
        return (f"{fmt_bytes(self.outside)} outside FLAME's pool after the CUDA graph capture: the pool's limit "
                f"lowered by {fmt_bytes(self.over)} to keep max_gpu_memory"
                + (f"; {len(self.demoted)} more blocks streamed" if self.demoted else ""))


def fit_outside_growth(streamer, max_gpu_memory, dev, max_demotions=3):
    """After a CUDA graph capture under a budget: the device memory outside FLAME's pool grew (the graph's
    executable, kernels and library workspaces its first replay loaded) past what auto_fit measured. The pool's
    limit comes down by what the limit plus that memory now exceed `max_gpu_memory` (bytes); while the pool holds
    more than its new limit, `streamer`'s resident blocks are demoted (at most `max_demotions` times: the caller
    captures again, its graphs were made with the old placement). A growth of more than a quarter of the pool's
    limit is not this process's graph (another process on the device): it is reported and left alone."""
    if max_gpu_memory is None or dev.type != "cuda":
        return OutsideGrowth(0, 0)
    limit = M.get_memory_limit(dev)
    if limit is None:
        return OutsideGrowth(0, 0)
    outside = outside_pool(dev)
    over = limit + outside - max_gpu_memory
    if over <= 0:
        return OutsideGrowth(outside, 0)
    if over > limit // 4:
        return OutsideGrowth(outside, over, foreign=True)
    M.set_memory_limit(limit - over, dev)
    M.empty_cache(dev)
    gone, rounds = [], 0
    while rounds < max_demotions and M.memory_reserved(dev) > limit - over:
        got = demote(streamer)
        if not got:
            break
        gone += got
        rounds += 1
        M.empty_cache(dev)
    return OutsideGrowth(outside, over, gone, rounds)


def _optional_parts(extra, extra_words, overhead, headroom):
    """The budget messages' parts for the memory a fit counts only when there is some."""
    g = fmt_bytes
    return ((f", {g(extra)} of {extra_words}" if extra else "")
            + (f", {g(overhead)} outside FLAME's pool (CUDA context, libraries)" if overhead else "")
            + (f", {g(headroom)} headroom" if headroom else ""))


def _minimum_message(budget, overhead, static, peak, extra, slots, nslots, headroom, savers=""):
    g = fmt_bytes
    minimum = peak + extra + overhead
    return (f"max_gpu_memory {g(budget)} is below the minimum of {g(minimum + headroom)} this model needs for one "
            f"step with every block streamed: {g(static - slots)} held on the device (weights outside the blocks, "
            f"trainable parameters and their gradients), {nslots} streaming slots of {g(slots / max(nslots, 1))}, "
            f"{g(peak - static)} of activations and workspace at the step's peak"
            + _optional_parts(extra, "state allocated later (optimizer)", overhead, headroom)
            + savers + ". Raise max_gpu_memory, store the frozen weights in fp8 (quantize), enable gradient "
                       "checkpointing, or lower the resolution / batch size.")


def _measure(streamer, step_fn, dev, count_driver_overhead, overhead):
    """One step with every block streamed, from an emptied cache: (static, peak, overhead) in bytes."""
    streamer.set_resident([])
    gc.collect()
    M.empty_cache(dev)
    static = M.memory_reserved(dev)
    M.reset_peak_memory_stats(dev)
    step_fn()
    peak = max(M.max_memory_reserved(dev), static)
    if count_driver_overhead:  # the first step may load kernels and make library workspaces outside the pool
        overhead = max(overhead, outside_pool(dev))
    return static, peak, overhead


def _outside_saving(streamer):
    """Bytes fp8 storage of the weights outside the blocks would save, or None where it is not offered: only when
    the blocks are fp8 already (the user chose fp8's numbers) and the streamer knows the model (for_model)."""
    if getattr(streamer, "quantize", None) not in ("fp8", "float8_e4m3fn") or not getattr(streamer, "outside_modules",
                                                                                        None):
        return None
    from .outside import outside_fp8_candidates
    return sum(saved for _, _, saved in outside_fp8_candidates(streamer.outside_modules)) or None


def auto_fit(streamer, max_gpu_memory, step_fn, *, extra_bytes=0, headroom=None, enforce=True, verify=True,
             verify_steps=3, margin=None, count_driver_overhead=True, offload_activations=None):
    """Choose `streamer`'s resident blocks so that a step (`step_fn()`, forward + backward) fits `max_gpu_memory`
    (bytes or a string such as '12GiB'); raise MemoryBudgetError naming the minimum when it cannot.

    extra_bytes   device memory the step will need that `step_fn` does not allocate (e.g. AdamW moments created at
                  the first optimizer step)
    headroom      bytes kept free for fragmentation and variation (default 2% of the budget)
    enforce       leave the budget set as the pool's limit (allocations beyond it then fail rather than grow)
    verify        run the step again under the limit, demoting blocks until it fits
    verify_steps  how many steps the verification runs (the pool's layout drifts from step to step)
    margin        the verification runs under a limit this much below the budget (default headroom // 2)
    count_driver_overhead   on cuda, count the device memory outside the pool (context etc.) against the budget
    offload_activations     None: turned on only when the budget needs it (left on when the streamer's owner
                  turned it on; one an earlier fit turned on is decided again);
                  True / False: on / off whatever the budget
    Returns a FitReport."""
    budget = parse_size(max_gpu_memory)
    if budget is None or budget <= 0:
        raise MemoryBudgetError(f"max_gpu_memory must be a positive size, got {max_gpu_memory!r}")
    dev = streamer.device
    headroom = int(0.02 * budget) if headroom is None else int(headroom)
    margin = headroom // 2 if margin is None else int(margin)
    extra = int(extra_bytes)
    prev_limit = M.get_memory_limit(dev)
    M.set_memory_limit(None, dev)
    can_offload = hasattr(streamer, "activations")  # (a stand-in streamer in tests may not offer it)
    if offload_activations is not None and can_offload:
        streamer.offload_activations = bool(offload_activations)
    elif can_offload and getattr(streamer, "_offload_by_fit", False):
        streamer.offload_activations = False  # an earlier fit turned it on: this budget decides again
    offloading = can_offload and streamer.offload_activations
    auto_offload = can_offload and offload_activations is None and not offloading

    # 1. everything streamed; what is held now
    streamer.set_resident([])
    gc.collect()
    M.empty_cache(dev)
    overhead = outside_pool(dev) if count_driver_overhead else 0
    static = M.memory_reserved(dev)
    slots = streamer.slot_bytes * (streamer.num_slots if streamer.streamed else 0)
    outside = _outside_saving(streamer)
    if static - (outside or 0) + extra + overhead + headroom > budget:
        M.set_memory_limit(prev_limit, dev)
        g = fmt_bytes
        raise MemoryBudgetError(
            f"max_gpu_memory {g(budget)} is below the minimum this model needs even before a step runs: "
            f"{g(static + extra + overhead + headroom)} with every block streamed ({g(static - slots)} held on the "
            f"device outside the blocks, {streamer.num_slots} streaming slots of {g(streamer.slot_bytes)}"
            + _optional_parts(extra, "optimizer state", overhead, headroom)
            + "), and a step's activations come on top. Raise max_gpu_memory or store the frozen weights in fp8.",
            minimum=static + extra + overhead + headroom)

    # 2. one measured step (counting the block inputs activation offload would move), then the plan
    from .activations import ActivationOffload
    if auto_offload:
        streamer.activations = ActivationOffload(dev, count_only=True)
    elif offloading:
        streamer.activations.reset_stats()
    try:
        static, peak, overhead = _measure(streamer, step_fn, dev, count_driver_overhead, overhead)
        counted = dict(streamer.activations.stats) if (auto_offload or offloading) else {}
        if auto_offload:
            streamer.activations = None
        plan = plan_budget(budget, held=static - slots + extra, slots=slots, activations=peak - static,
                           overhead=overhead, headroom=headroom, offloadable=counted.get("bytes_step", 0),
                           offload_block=counted.get("block_max", 0), outside_fp8=outside,
                           offload_activations=None if auto_offload else offloading,
                           measured_offloaded=offloading)
        outside_names, outside_bytes = [], 0
        if (plan.offload_activations and not offloading) or plan.quantize_outside:
            if can_offload:
                offloading = streamer.offload_activations = plan.offload_activations
                streamer._offload_by_fit = offloading
            if plan.quantize_outside:
                outside_bytes = streamer.quantize_outside_()
                outside_names = list(streamer.outside_fp8)
            static, peak, overhead = _measure(streamer, step_fn, dev, count_driver_overhead, overhead)
        if peak + extra + overhead + headroom > budget and outside and not outside_bytes:
            # the offload saved less than planned: the fp8 outside the blocks is the saver left
            plan.quantize_outside = True
            plan.steps.append(("measured" + (" with the block inputs offloaded" if offloading else ""),
                               peak + extra + overhead))
            outside_bytes = streamer.quantize_outside_()
            outside_names = list(streamer.outside_fp8)
            static, peak, overhead = _measure(streamer, step_fn, dev, count_driver_overhead, overhead)
    except OutOfMemoryError as e:
        if auto_offload and streamer.activations is not None and streamer.activations.count_only:
            streamer.activations = None  # the probe of the measured step
        M.set_memory_limit(prev_limit, dev)
        raise MemoryBudgetError(f"one step does not fit in the device's memory even with every block streamed "
                                f"(static part {fmt_bytes(static)}); {e}", minimum=static) from e
    minimum = peak + extra + overhead
    if minimum + headroom > budget:
        M.set_memory_limit(prev_limit, dev)
        savers = ((f" (with {fmt_bytes(plan.offloadable)} of block inputs offloaded to host memory"
                   + (f" and {fmt_bytes(outside_bytes)} of the weights outside the blocks in fp8" if outside_bytes
                      else "") + ")") if offloading else "")
        raise MemoryBudgetError(_minimum_message(budget, overhead, static, peak, extra, slots, streamer.num_slots,
                                                 headroom, savers), minimum=minimum + headroom)

    # 3. fill the rest with resident blocks
    chosen = _choose(streamer, budget - headroom - minimum, dev)
    _place(streamer, chosen, dev)
    report = FitReport(budget=budget, overhead=overhead, minimum=minimum, static=static, plan=plan,
                       offload_activations=offloading, outside_fp8=outside_names,
                       outside_fp8_bytes=outside_bytes)

    # 4. verify under the budget less the margin, then the budget as the pool's limit
    if verify:
        # `extra` (state made later, e.g. at the first optimizer step) is not allocated by the verification steps:
        # they leave room for it, or the first real step after them is the one that does not fit
        report.verify_limit = budget - overhead - max(0, margin) - extra
        M.set_memory_limit(report.verify_limit, dev)
        n_steps = max(1, int(verify_steps))
        while True:
            peaks, failed = [], None
            try:
                for _ in range(n_steps):
                    gc.collect()
                    M.reset_peak_memory_stats(dev)
                    step_fn()
                    peaks.append(M.max_memory_reserved(dev))
            except OutOfMemoryError as e:
                failed = str(e).splitlines()[0]  # not the exception: its frames hold the failed step's tensors
            if failed is None:
                report.verify_peaks = peaks
                report.measured_peak = max(peaks)
                break
            if not chosen:
                M.set_memory_limit(prev_limit, dev)
                raise MemoryBudgetError(
                    f"max_gpu_memory {fmt_bytes(budget)}: with every block streamed one step fitted (pool peak "
                    f"{fmt_bytes(peak)}) but {n_steps} steps in a row do not fit under {fmt_bytes(report.verify_limit)}"
                    f" (the budget less the overhead outside the pool, a margin of {fmt_bytes(max(0, margin))}"
                    + (f" and {fmt_bytes(extra)} of state allocated later" if extra else "") + "): "
                    f"the pool's layout drifts from step to step. Raise max_gpu_memory or the headroom. {failed}",
                    minimum=minimum + headroom + max(0, margin))
            report.demoted += len(demote(streamer))
            chosen = streamer.resident
    # on cuda the device memory outside the pool keeps growing after the fit (a CUDA graph's executable, kernels
    # loaded later, library workspaces): the pool stays a margin below what the fit left it
    growth = max(0, margin) if dev.type == "cuda" and count_driver_overhead else 0
    M.set_memory_limit(budget - overhead - growth if enforce else prev_limit, dev)
    report.resident = streamer.resident
    report.streamed = streamer.streamed
    report.resident_bytes = sum(streamer.block_bytes(i) for i in report.resident)
    report.streamed_bytes = sum(streamer.block_bytes(i) for i in report.streamed)
    report.slot_bytes = streamer.slot_bytes if report.streamed else 0
    report.num_slots = streamer.num_slots if report.streamed else 0
    if offloading:
        report.offloaded_bytes = streamer.activations.stats["bytes_step"]
        report.activation_host_bytes = streamer.activations.host_bytes
    report.host_pinned_bytes = streamer.host_pinned_bytes + report.activation_host_bytes
    report.host_mapped_bytes = streamer.host_mapped_bytes
    return report
