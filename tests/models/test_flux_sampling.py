"""Flux sampling utilities: packing, position ids, the schedule and seeded noise."""
import math

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_models.flux import Flux, flux_params
from flame_models.flux import sampling as S
from flame_models.flux.keys import bfl_shapes


def test_pack_places_each_latent_value_where_the_spec_says(device):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 16, 6, 10)).astype(np.float32)     # a 48x80 image
    x = S.pack(flame.tensor(z, device=device)).numpy()
    assert x.shape == (2, 3 * 5, 64)
    for b, r, c, ch, ph, pw in [(0, 0, 0, 0, 0, 0), (1, 2, 4, 15, 1, 1), (0, 1, 3, 7, 0, 1), (1, 2, 0, 3, 1, 0)]:
        assert x[b, r * 5 + c, ch * 4 + ph * 2 + pw] == z[b, ch, 2 * r + ph, 2 * c + pw]
    # the whole map against an independent index computation
    b, t, f = np.meshgrid(np.arange(2), np.arange(15), np.arange(64), indexing="ij")
    r, c, ch, ph, pw = t // 5, t % 5, f // 4, (f // 2) % 2, f % 2
    np.testing.assert_array_equal(x, z[b, ch, 2 * r + ph, 2 * c + pw])


def test_unpack_is_the_exact_inverse_of_pack(device):
    rng = np.random.default_rng(1)
    z = flame.tensor(rng.standard_normal((1, 16, 8, 4)).astype(np.float32), device=device)
    np.testing.assert_array_equal(S.unpack(S.pack(z), 64, 32).numpy(), z.numpy())
    x = flame.tensor(rng.standard_normal((3, 8, 64)).astype(np.float32), device=device)
    np.testing.assert_array_equal(S.pack(S.unpack(x, 32, 64)).numpy(), x.numpy())
    with pytest.raises(ValueError, match=r"\(B, 8, 4C\)"):
        S.unpack(x[:, :7], 32, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        S.unpack(x, 30, 64)


def test_image_and_text_ids(device):
    ids = S.image_ids(48, 80, batch_size=2, device=device).numpy()
    assert ids.shape == (2, 15, 3) and ids.dtype == np.float32
    want = np.array([(0, r, c) for r in range(3) for c in range(5)], dtype=np.float32)
    np.testing.assert_array_equal(ids[0], want)
    np.testing.assert_array_equal(ids[1], want)
    t = S.text_ids(7, 2, device=device).numpy()
    assert t.shape == (2, 7, 3) and not t.any()


def test_schedule_shift_follows_the_resolution():
    assert S.shift_mu(256) == pytest.approx(0.5) and S.shift_mu(4096) == pytest.approx(1.15)
    ts = S.get_schedule(4, 4096, shift=True)
    assert ts[0] == 1.0 and ts[-1] == 0.0
    mu = 1.15
    for t_lin, t in zip([1.0, 0.75, 0.5, 0.25, 0.0], ts):
        if 0 < t_lin < 1:
            assert t == pytest.approx(math.exp(mu) / (math.exp(mu) + 1 / t_lin - 1), rel=1e-12)
    assert ts[2] == pytest.approx(math.exp(mu) / (math.exp(mu) + 1.0))   # t=0.5 -> sigmoid(mu)
    assert all(a > b for a, b in zip(ts, ts[1:]))
    assert S.get_schedule(4, 4096, shift=False) == [1.0, 0.75, 0.5, 0.25, 0.0]
    # more tokens shift harder: every interior time is later at 1024^2 than at 512^2
    lo, hi = S.get_schedule(10, 1024), S.get_schedule(10, 4096)
    assert all(h > l for h, l in zip(hi[1:-1], lo[1:-1]))


def test_noise_is_deterministic_per_seed(device):
    a = S.get_noise(2, 32, 48, seed=7, device=device).numpy()
    b = S.get_noise(2, 32, 48, seed=7, device=device).numpy()
    c = S.get_noise(2, 32, 48, seed=8, device=device).numpy()
    assert a.shape == (2, 16, 4, 6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert abs(a.mean()) < 0.2 and 0.8 < a.std() < 1.2


class VelocityIsState(flame_nn.Module):
    """A stand-in model whose velocity is its input: Euler then multiplies x by prod(1 + dt)."""

    def __init__(self, params):
        super().__init__()
        self.params = params
        self.w = flame_nn.Parameter(flame.ones(1))
        self.calls = []

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None):
        self.calls.append((timesteps.numpy().tolist(), None if guidance is None else guidance.numpy().tolist(),
                           tuple(img_ids.shape), tuple(txt_ids.shape)))
        return img * self.w


def test_euler_sampler_follows_the_schedule(device):
    model = VelocityIsState(flux_params("flux-dev"))
    txt, y = flame.zeros(2, 7, 4096, device=device), flame.zeros(2, 768, device=device)
    # cuda_graph=False: the recording model reads values back to the host, which a graph capture cannot do
    out = S.sample(model, txt, y, height=64, width=32, steps=3, guidance=4.0, seed=11, cuda_graph=False)
    ts = S.get_schedule(3, 8, shift=True)
    assert [c[0] for c in model.calls] == [[t, t] for t in np.float32(ts[:-1]).tolist()]
    assert all(c[1] == [4.0, 4.0] and c[2] == (2, 8, 3) and c[3] == (2, 7, 3) for c in model.calls)
    factor = np.prod([1 + (b - a) for a, b in zip(ts[:-1], ts[1:])])
    noise = S.get_noise(2, 64, 32, seed=11, device=device).numpy()
    assert out.shape == (2, 16, 8, 4)
    np.testing.assert_allclose(out.numpy(), noise * factor, rtol=1e-5, atol=1e-6)
    schnell = VelocityIsState(flux_params("flux-schnell"))
    S.sample(schnell, txt, y, height=32, width=32, seed=0, cuda_graph=False)
    assert [c[0][0] for c in schnell.calls] == [1.0, 0.75, 0.5, 0.25] and schnell.calls[0][1] is None


def test_sampler_with_a_tiny_flux_is_deterministic_per_seed(device):
    rng = np.random.default_rng(0)
    p = flux_params("flux-tiny")
    with flame_nn.empty_init(device=device, dtype=flame.float32):
        model = Flux(p)
    model.load_state_dict({k: (0.05 * rng.standard_normal(s)).astype(np.float32)
                           for k, s in bfl_shapes(p).items()})
    txt = flame.tensor(rng.standard_normal((1, 4, 32)).astype(np.float32), device=device)
    y = flame.tensor(rng.standard_normal((1, 16)).astype(np.float32), device=device)
    a = S.sample(model, txt, y, height=32, width=48, steps=3, guidance=3.5, seed=5).numpy()
    b = S.sample(model, txt, y, height=32, width=48, steps=3, guidance=3.5, seed=5).numpy()
    c = S.sample(model, txt, y, height=32, width=48, steps=3, guidance=3.5, seed=6).numpy()
    assert a.shape == (1, 16, 4, 6) and np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).mean() > 0.1


@pytest.mark.gpu
def test_graphed_sampler_gives_the_eager_latents():
    rng = np.random.default_rng(1)
    p = flux_params("flux-tiny")
    with flame_nn.empty_init(device="cuda", dtype=flame.bfloat16):
        model = Flux(p)
    model.load_state_dict({k: (0.05 * rng.standard_normal(s)).astype(np.float32)
                           for k, s in bfl_shapes(p).items()})
    txt = flame.tensor(rng.standard_normal((1, 4, 32)).astype(np.float32), device="cuda")
    y = flame.tensor(rng.standard_normal((1, 16)).astype(np.float32), device="cuda")
    kw = dict(height=32, width=48, steps=6, guidance=3.5, seed=5)
    eager = S.sample(model, txt, y, cuda_graph=False, **kw).numpy()
    graphed = S.sample(model, txt, y, cuda_graph=True, **kw).numpy()
    np.testing.assert_array_equal(graphed, eager)
