"""A random-init Flux-dev-size model on the GPU for the benches, built without fragmenting FLAME's pool.

Each parameter is allocated once in its final dtype and filled from a fixed-size float32 scratch draw, so the
temporaries are the same size every time (the pool reuses one block) and leave no holes between the weights. (A
real model is loaded file tensor by file tensor in its stored dtype, which fragments nothing either.)
"""
import flame_core as flame
import flame_nn
from flame_core import backend
from flame_models.flux import Flux
from flame_models.flux.params import configs

CHUNK = 1 << 26  # elements per draw


def random_flux(params="flux-dev", device="cuda", dtype=flame.bfloat16, seed=0, std=0.02, **changes):
    p = configs[params] if isinstance(params, str) else params
    if changes:
        p = p.replace(**changes)
    with flame_nn.empty_init(device=device, dtype=dtype):
        model = Flux(p)
    g = flame.Generator(device).manual_seed(seed)
    xp = backend.xp_for(flame.device(device))
    with flame.no_grad():
        for name, prm in model.named_parameters():
            arr = xp.empty(prm.shape, dtype=dtype.np)
            flat = arr.reshape(-1)
            if name.endswith(".scale"):  # QK-norm gains: 1
                flat.fill(1)
            else:
                for i in range(0, flat.size, CHUNK):
                    n = min(CHUNK, flat.size - i)
                    draw = flame.randn(CHUNK, generator=g, device=device)._data
                    draw *= std
                    flat[i:i + n] = draw[:n]
                    del draw
            prm.materialize_(arr)
    return model
