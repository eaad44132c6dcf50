"""SD3 sampling: the shifted schedule against diffusers' FlowMatchEulerDiscreteScheduler(shift=3), and CFG Euler runs
(with skip-layer guidance) against diffusers' scheduler + SD3Transformer2DModel in the SD3 pipeline's loop."""
import json

import numpy as np
import pytest
from sd3_helpers import FIXTURES, diffusers_dir, inputs, io, meta, npy

import flame_core as flame
from flame_models.sd3 import SAMPLING_DEFAULTS, SkipLayerGuidance, get_noise, get_sigmas, load_sd3, sample, shift_sigma


@pytest.mark.parametrize("steps", [1, 2, 4, 28, 40, 50])
def test_sigmas_match_diffusers_flow_match_euler_with_shift_3(steps):
    ref = json.loads((FIXTURES / "scheduler.json").read_text())[str(steps)]
    sigmas = get_sigmas(steps)
    assert len(sigmas) == steps + 1 and sigmas[-1] == 0.0 and sigmas[0] == 1.0
    np.testing.assert_allclose(sigmas, ref["sigmas"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose([1000 * s for s in sigmas[:-1]], ref["timesteps"], rtol=1e-6)


def test_shift_function():
    u = np.linspace(0, 1, 11)
    s = np.array([shift_sigma(x) for x in u])
    assert s[0] == 0 and s[-1] == 1 and np.all(np.diff(s) > 0) and np.all(s[1:-1] > u[1:-1])
    assert shift_sigma(0.25, shift=1.0) == 0.25
    assert shift_sigma(0.5) == pytest.approx(0.75)
    # the low end is shifted twice (t_min = 1000 s(0.001), then sigma = s(t / 1000)), as SAI's and diffusers'
    assert get_sigmas(3)[-2] == pytest.approx(shift_sigma(shift_sigma(0.001)))
    with pytest.raises(ValueError):
        get_sigmas(0)


def run(variant, device, **kw):
    arrays = io(variant)
    model = load_sd3(diffusers_dir(variant), dtype=flame.float32, device=device)
    ctx, y, neg_ctx, neg_y, noise = inputs(arrays, flame.float32, device,
                                           ("context", "y", "neg_context", "neg_y", "noise"))
    return arrays, model, dict(context=ctx, y=y, neg_context=neg_ctx, neg_y=neg_y, height=48, width=80,
                               latents=noise, **kw)


@pytest.mark.parametrize("variant", ["plain", "dual"])
def test_cfg_euler_sampling_matches_diffusers(variant, device):
    m = meta(variant)["sample_cfg"]
    slg = None if m["slg"] is None else SkipLayerGuidance(layers=tuple(m["slg"]["layers"]), scale=m["slg"]["scale"],
                                                          start=m["slg"]["start"], stop=m["slg"]["stop"])
    arrays, model, args = run(variant, device, steps=m["steps"], cfg=m["cfg"])
    out = sample(model, skip_layer_guidance=slg, **args)
    ref = arrays["sample_cfg"]
    assert out.shape == ref.shape == (2, 16, 6, 10) and out.dtype == flame.float32
    np.testing.assert_allclose(npy(out), ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    if slg is not None:  # the guidance term matters at this tolerance
        plain = npy(sample(model, **args))
        assert np.abs(plain - ref).max() > 100 * 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["plain", "dual"])
def test_unguided_sampling_matches_diffusers(variant, device):
    m = meta(variant)["sample_nocfg"]
    arrays, model, args = run(variant, device, steps=m["steps"], cfg=m["cfg"])
    args.update(neg_context=None, neg_y=None)
    out = npy(sample(model, **args))
    ref = arrays["sample_nocfg"]
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_sampling_errors_and_seeds(device):
    arrays, model, args = run("plain", device, steps=2, cfg=3.0)
    with pytest.raises(ValueError, match="negative prompt"):
        sample(model, **{**args, "neg_context": None})
    with pytest.raises(ValueError, match="must match"):
        sample(model, **{**args, "neg_context": args["neg_context"][:, :3]})
    with pytest.raises(ValueError, match="latents must have shape"):
        sample(model, **{**args, "height": 64})
    with pytest.raises(ValueError, match="multiples of 16"):
        sample(model, **{**args, "width": 72, "latents": None})
    args.update(latents=None, steps=1)
    a, b = npy(sample(model, seed=7, **args)), npy(sample(model, seed=7, **args))
    c = npy(sample(model, seed=8, **args))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 0.1
    noise = get_noise(2, 48, 80, seed=7, device=device)
    assert noise.shape == (2, 16, 6, 10)


def test_release_defaults():
    assert SAMPLING_DEFAULTS["sd3.5-large"] == dict(steps=40, cfg=4.5)
    assert SAMPLING_DEFAULTS["sd3.5-large-turbo"] == dict(steps=4, cfg=1.0)
    medium = SAMPLING_DEFAULTS["sd3.5-medium"]
    assert medium["steps"] == 50 and medium["cfg"] == 5.0
    slg = medium["skip_layer_guidance"]
    assert slg.layers == (7, 8, 9) and slg.scale == 2.5
    assert [i for i in range(50) if slg.active(i, 50)] == list(range(1, 15))  # 0.5 < i < 15


@pytest.mark.gpu
def test_cuda_graph_sampling_equals_eager():
    """On cuda each kind of step is captured once and replayed (a host sync in the forward would fail the capture)."""
    m = meta("dual")["sample_cfg"]
    _, model, args = run("dual", "cuda", steps=m["steps"], cfg=m["cfg"])
    slg = SkipLayerGuidance(layers=(1,), scale=2.0, start=0.0, stop=1.0)
    graphed = npy(sample(model, skip_layer_guidance=slg, cuda_graph=True, **args))
    eager = npy(sample(model, skip_layer_guidance=slg, cuda_graph=False, **args))
    np.testing.assert_allclose(graphed, eager, rtol=1e-6, atol=1e-6)
