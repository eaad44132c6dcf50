"""What the flow samplers' tests against diffusers share (test_flow_dpmpp, _dpmpp_sde, _unipc, _heun): the fixture
(tests/fixtures/make_flow_sampler_fixtures.py: its cases' tables and trajectories, the pattern and the starting
noise), its fixed velocity model v(x, t) = tanh(0.8 x) + pattern t / 1000, and that model standing in for SD3's
MMDiT and Flux's transformer in their denoising loops."""
import json
from pathlib import Path

import flame_core as flame
from flame_core.io import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flow_samplers"
META = json.loads((FIXTURES / "flow_samplers.json").read_text())["cases"]
ARRAYS = load_file(str(FIXTURES / "flow_samplers.safetensors"))


def cases(scheduler):
    """The fixture's cases made by `scheduler` (the name its JSON records), sorted."""
    return sorted(k for k, m in META.items() if m["scheduler"] == scheduler)


def pattern(device):
    return flame.tensor(ARRAYS["pattern"].numpy(), device=device)


def noise(device):
    """The fixture's starting noise (1, 4, 4, 4)."""
    return flame.tensor(ARRAYS["noise"].numpy(), device=device)


def velocity(device):
    """v(x, t) with t the model's timestep (sigma * 1000), as the fixture's."""
    p = pattern(device)
    return lambda x, t: flame.tanh(0.8 * x) + p * (t.reshape(-1, 1, 1, 1) / 1000)


class SD3Like:
    """The fixture's velocity model as an SD3 MMDiT for sd3.sampling.denoise (timesteps sigma * 1000)."""

    def __init__(self, device):
        self.pattern = pattern(device)

    def parameters(self):
        return iter(())

    def modules(self):
        return iter((self,))

    def __call__(self, x, t, y, context):
        return flame.tanh(0.8 * x) + self.pattern * (t.reshape(-1, 1, 1, 1) / 1000)


class FluxLike(SD3Like):
    """The same as a Flux transformer for bfl.sampling.denoise (timesteps sigma)."""

    def __call__(self, img, img_ids, txt, txt_ids, timesteps, y, guidance):
        return flame.tanh(0.8 * img) + self.pattern * timesteps.reshape(-1, 1, 1, 1)


def sd3_denoise(device, sigmas, **kw):
    """sd3.sampling.denoise of the fixture's noise along `sigmas` with the stand-in (kw: sampler, step_noise, ...)."""
    from flame_models.sd3.sampling import denoise
    return denoise(SD3Like(device), noise(device), sigmas, flame.zeros(1, 2, 3, device=device),
                   flame.zeros(1, 3, device=device), **kw)


def flux_denoise(device, sigmas, **kw):
    """bfl.sampling.denoise of the fixture's noise along `sigmas` (CUDA graphs on a GPU) with the stand-in."""
    from flame_models.bfl import sampling
    return sampling.denoise(FluxLike(device), noise(device), None, None, None, None, sigmas, None, **kw)


def check_loops(case, device, sampler, atol, other, **kw):
    """SD3's denoise (timesteps 1000 s) and Flux's (timesteps s; CUDA graphs on a GPU: warm-up, capture, replays)
    with `sampler` end on the fixture case's last sample (within atol), Flux's calling back once per step; `other`,
    another sampler, ends elsewhere (the sampler is not it renamed). kw: more for both loops (step_noise)."""
    import numpy as np
    m = META[case]
    sigmas = m["sigmas"]
    ref = ARRAYS[f"{case}.trajectory"].numpy()
    out = sd3_denoise(device, sigmas, sampler=sampler, **kw)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref[-1], rtol=0, atol=atol)
    seen = []
    out = flux_denoise(device, sigmas, callback=lambda i, n: seen.append((i, n)), sampler=sampler, **kw)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref[-1], rtol=0, atol=atol)
    assert seen == [(i, m["steps"]) for i in range(1, m["steps"] + 1)]
    alt = flux_denoise(device, sigmas, sampler=other)
    assert np.abs(alt.float().cpu().numpy() - out.float().cpu().numpy()).max() > 1e-4
