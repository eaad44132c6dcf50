"""The steps of flow-matching samplers (SD3, Flux) over a velocity field v(x, t) on a table of sigmas (high to 0):

    euler  x <- x + (s' - s) v(x, s)
    heun   x_e = x + (s' - s) v(x, s);  x <- x + (s' - s) (v(x, s) + v(x_e, s')) / 2;  Euler into s' = 0
           (diffusers' FlowMatchHeunDiscreteScheduler: 2 model calls a step, 1 for the last)
"""
FLOW_SAMPLERS = ("euler", "heun")


def check_flow_sampler(sampler):
    """`sampler` if it is one of FLOW_SAMPLERS, else a ValueError naming them."""
    if sampler not in FLOW_SAMPLERS:
        raise ValueError(f"unknown flow-matching sampler {sampler!r}: choose one of {', '.join(FLOW_SAMPLERS)}")
    return sampler


def flow_step(velocity, sampler):
    """step(x, t, t_next, dt) -> x at the next sigma, by `sampler` over velocity(x, t) (t, t_next: the model's
    timestep tensors at s and s'; dt = s' - s). Euler does not read t_next."""
    if check_flow_sampler(sampler) == "euler":
        return lambda x, t, t_next, dt: x + dt * velocity(x, t)

    def heun(x, t, t_next, dt):
        v = velocity(x, t)
        return x + dt * (0.5 * (v + velocity(x + dt * v, t_next)))
    return heun


def step_kind(sampler, i, steps):
    """The sampler of step i of `steps`: Heun's last step (into sigma 0) is Euler's, as diffusers'."""
    return "euler" if i == steps - 1 else check_flow_sampler(sampler)
