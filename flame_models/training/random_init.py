"""Random weights for models built under `flame_nn.empty_init`, drawn on their target device one parameter at a
time: a Flux-dev-size model (11.9B parameters) fills in seconds on a GPU, where a host-side init would take minutes,
and never holds more than one parameter's float32 draw besides the weights.

    with flame_nn.empty_init(device="cuda", dtype=flame.bfloat16):
        model = Flux("flux-dev")
    init_random_(model.img_in, flame.Generator("cuda").manual_seed(0))   # or one block at a time (the streamer's
                                                                          # `prepare`), so it is never whole on the GPU
Normalisation gains are 1 and their biases 0 (parameters of a module whose class name has "Norm", and QK-norm
`.scale` vectors); every other parameter is N(0, std^2). Random weights are for measuring time and memory at the
real sizes (benchmarks), not for producing images.
"""
import flame_core as flame


def _is_norm(module_name, module, param_name):
    return "Norm" in type(module).__name__ or param_name == "scale"


def init_random_(module, generator=None, std=0.02, only_empty=True):
    """Give every parameter of `module` random values on its device (only the meta placeholders of empty_init
    when `only_empty`); see the module docstring. Returns the number of parameters filled."""
    n = 0
    with flame.no_grad():
        for mname, mod in module.named_modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                if only_empty and not p.is_meta:
                    continue
                dev, dt = p.device, p.dtype
                if _is_norm(mname, mod, pname):
                    fill = 1.0 if pname in ("weight", "scale") else 0.0
                    value = flame.full(tuple(p.shape), fill, dtype=dt, device=dev)
                else:
                    g = generator if generator is not None and generator.device.type == dev.type else None
                    value = (flame.randn(*p.shape, generator=g, dtype=flame.float32, device=dev) * std).to(dt)
                p.copy_(value)
                del value
                n += 1
    return n
