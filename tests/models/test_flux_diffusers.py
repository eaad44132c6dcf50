"""FLAME's Flux against diffusers' FluxTransformer2DModel (an independent implementation) on the same weights.
GPU only; skipped where torch or diffusers is not importable (the device image has torch; the bench run carries the
diffusers wheel)."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_models.flux import Flux, flux_params
from flame_models.flux import keys as K
from flame_models.flux import sampling as S
from flame_models.flux.loading import _diffusers_config

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.gpu


def build_pair(p, dtype, seed=0):
    """The same random weights in a FLAME Flux and a diffusers FluxTransformer2DModel, both on the GPU."""
    g = flame.Generator("cuda").manual_seed(seed)
    state = {}
    for k, s in K.bfl_shapes(p).items():
        w = flame.randn(*s, generator=g, device="cuda") * (0.3 if k.endswith(".scale") else 0.02)
        state[k] = w + 1 if k.endswith(".scale") else w
    with flame_nn.empty_init(device="cuda", dtype=dtype):
        ours = Flux(p)
    ours.load_state_dict(state)
    config = {k: v for k, v in _diffusers_config(p).items() if not k.startswith("_")}
    with torch.device("cuda"):
        theirs = diffusers.FluxTransformer2DModel(**config).to(dtype=getattr(torch, dtype.name))
    dstate = {k: torch.from_dlpack(v._data) for k, v in K.bfl_to_diffusers(state, p).items()}
    missing, unexpected = theirs.load_state_dict(dstate, strict=True)
    assert not missing and not unexpected
    return ours, theirs


def run_pair(ours, theirs, p, dtype, height, width, n_txt, seed=1):
    rng = np.random.default_rng(seed)
    L = (height // 16) * (width // 16)
    arrays = dict(img=rng.standard_normal((1, L, p.in_channels)), txt=rng.standard_normal((1, n_txt, p.context_in_dim)),
                  y=rng.standard_normal((1, p.vec_in_dim)), t=np.array([0.375]), g=np.array([3.5]))
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    f = {k: flame.tensor(v, dtype=dtype, device="cuda") for k, v in arrays.items()}
    img_ids = S.image_ids(height, width, device="cuda")
    txt_ids = S.text_ids(n_txt, device="cuda")
    with flame.no_grad():
        out = ours(img=f["img"], img_ids=img_ids, txt=f["txt"], txt_ids=txt_ids, timesteps=f["t"], y=f["y"],
                   guidance=f["g"]).float().numpy()
    tdtype = getattr(torch, dtype.name)
    tt = {k: torch.tensor(v, device="cuda").to(tdtype) for k, v in arrays.items()}
    with torch.no_grad():
        ref = theirs(hidden_states=tt["img"], encoder_hidden_states=tt["txt"], pooled_projections=tt["y"],
                     timestep=tt["t"], img_ids=torch.tensor(img_ids.numpy()[0], device="cuda"),
                     txt_ids=torch.tensor(txt_ids.numpy()[0], device="cuda"), guidance=tt["g"], return_dict=False)[0]
    return out, ref.float().cpu().numpy()


def test_tiny_flux_matches_diffusers_in_float32():
    p = flux_params("flux-tiny")
    ours, theirs = build_pair(p, flame.float32)
    out, ref = run_pair(ours, theirs, p, flame.float32, 64, 48, 7)
    assert out.shape == ref.shape == (1, 12, 64) and np.abs(ref).mean() > 1e-3
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_full_width_flux_blocks_match_diffusers_in_bfloat16():
    """Real widths (H 3072, 24 heads of 128, RoPE axes 16/56/56, T5 4096, CLIP 768), one block of each kind."""
    p = flux_params("flux-dev").replace(depth=1, depth_single_blocks=1)
    ours, theirs = build_pair(p, flame.bfloat16)
    out, ref = run_pair(ours, theirs, p, flame.bfloat16, 256, 512, 64)
    assert out.shape == ref.shape == (1, 512, 64)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 2e-2, f"relative difference to diffusers {err:.3e}"
