"""The memory plan of a streamed training step, on paper: from the parts a measured step is made of, which of the
memory savers a budget needs -- activation offload, then fp8 storage of the weights outside the blocks -- and the
minimum they leave. auto_fit decides with it, then measures that the plan holds; it also answers "would it fit?" for
figures measured elsewhere:

    plan = plan_budget("4GiB", held=839 * MiB, slots=2 * 325 * MiB, activations=2795 * MiB, overhead=683 * MiB,
                       offloadable=1512 * MiB, offload_block=27 * MiB)
    print(plan)          # what is held, streamed, offloaded; the minimum before and after; feasible or not

The parts (bytes): held -- on the device outside the blocks for the whole step (weights outside the blocks, trainable
parameters, their gradients, optimizer state); slots -- the streaming slots; activations -- what a step adds at its
peak (activations and workspace); overhead -- device memory outside FLAME's pool (CUDA context, libraries).
offloadable -- the checkpointed block inputs activation offload moves to host memory (per step), offload_block --
the largest block's share of it (about two blocks' worth stay on the device: the one being copied out, and the one
copied back ahead of its backward); outside_fp8 -- what fp8 storage of the weights outside the blocks would save
(None: not allowed, e.g. the blocks are kept in bf16, so the model's numbers are not changed behind the user's back).
"""
from dataclasses import dataclass, field

from flame_core.memory.stats import fmt_bytes, parse_size


@dataclass
class BudgetPlan:
    budget: int
    headroom: int
    held: int
    slots: int
    activations: int
    overhead: int
    offloadable: int = 0
    offload_block: int = 0
    outside_fp8: int = None
    offload_activations: bool = False
    quantize_outside: bool = False
    measured_offloaded: bool = False  # `activations` was measured with the inputs offloaded already
    steps: list = field(default_factory=list)  # [(what, minimum after it)]

    @property
    def base_minimum(self):
        """The need with nothing offloaded (everything streamed): held + slots + activations + overhead."""
        return self.held + self.slots + self.activations + self.overhead

    @property
    def offload_saving(self):
        if not self.offload_activations or self.measured_offloaded:
            return 0
        return max(0, self.offloadable - 2 * self.offload_block)

    @property
    def minimum(self):
        return self.base_minimum - self.offload_saving - ((self.outside_fp8 or 0) if self.quantize_outside else 0)

    @property
    def feasible(self):
        return self.minimum + self.headroom <= self.budget

    @property
    def spare(self):
        """Bytes left for resident blocks (negative: over the budget)."""
        return self.budget - self.headroom - self.minimum

    def __str__(self):
        g = fmt_bytes
        lines = [f"plan for {g(self.budget)}: {'fits' if self.feasible else 'does NOT fit'}; minimum "
                 f"{g(self.minimum)} + {g(self.headroom)} headroom ({g(self.spare)} left for resident blocks)",
                 f"  held on the device {g(self.held)}; streaming slots {g(self.slots)}; activations and workspace "
                 f"at the peak {g(self.activations)}; outside FLAME's pool {g(self.overhead)}"]
        if self.offload_activations:
            lines.append(f"  activations offloaded to pinned host memory: {g(self.offloadable)} per step"
                         + ("" if self.measured_offloaded else f", {g(self.offload_saving)} off the peak"))
        elif self.offloadable:
            lines.append(f"  activations kept on the device ({g(self.offloadable)} could be offloaded)")
        if self.quantize_outside:
            lines.append(f"  weights outside the blocks stored in fp8: {g(self.outside_fp8)} saved")
        for what, m in self.steps:
            lines.append(f"  {what}: minimum {g(m)}")
        return "\n".join(lines)


def plan_budget(budget, *, held, slots, activations, overhead=0, headroom=None, offloadable=0, offload_block=0,
                outside_fp8=None, offload_activations=None, measured_offloaded=False):
    """The BudgetPlan for `budget` (bytes or '4GiB'): the savers turned on in order, only while the minimum plus the
    headroom (default 2% of the budget) is over it. offload_activations: True/False forces it (None: as needed);
    measured_offloaded: the activations were measured with it on (it is on, and saves nothing more)."""
    budget = parse_size(budget)
    headroom = int(0.02 * budget) if headroom is None else int(headroom)
    plan = BudgetPlan(budget=budget, headroom=headroom, held=int(held), slots=int(slots),
                      activations=int(activations), overhead=int(overhead), offloadable=int(offloadable),
                      offload_block=int(offload_block), outside_fp8=None if outside_fp8 is None else int(outside_fp8),
                      measured_offloaded=bool(measured_offloaded))
    plan.steps.append(("everything streamed" + (", block inputs offloaded" if measured_offloaded
                                                 else ", nothing offloaded"), plan.minimum))
    want = True if measured_offloaded else offload_activations
    if want is None:
        want = not plan.feasible and plan.offloadable > 2 * plan.offload_block
    if want:
        plan.offload_activations = True
        if not measured_offloaded:
            plan.steps.append(("with the block inputs offloaded", plan.minimum))
    if not plan.feasible and plan.outside_fp8:
        plan.quantize_outside = True
        plan.steps.append(("with the weights outside the blocks in fp8", plan.minimum))
    return plan
