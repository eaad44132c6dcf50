"""FLAME's MMDiT against diffusers' SD3Transformer2DModel on the GPU, at the released widths (64-dim heads: the flash
attention kernels' D=64 path) and on the same random weights. GPU only; skipped where torch or diffusers is not
importable (the device image has torch; the bench run carries the diffusers wheel)."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_models.sd3 import MMDiT, sd3_params
from flame_models.sd3 import keys as K
from flame_models.sd3 import ops as O
from flame_models.sd3.loading import diffusers_config

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.gpu


def build_pair(p, dtype, seed=0):
    """The same random weights in a FLAME MMDiT and a diffusers SD3Transformer2DModel, both on the GPU."""
    g = flame.Generator("cuda").manual_seed(seed)
    state = {}
    for k, s in K.sai_shapes(p).items():
        if k == "pos_embed":
            state[k] = O.pos_embed_tensor(p, flame.float32, "cuda")
        elif ".ln_" in k:
            state[k] = 1 + 0.3 * flame.randn(*s, generator=g, device="cuda")
        else:
            state[k] = 0.02 * flame.randn(*s, generator=g, device="cuda")
    with flame_nn.empty_init(device="cuda", dtype=dtype):
        ours = MMDiT(p)
    ours.load_state_dict(state)
    config = {k: v for k, v in diffusers_config(p).items() if not k.startswith("_")}
    with torch.device("cuda"):
        theirs = diffusers.SD3Transformer2DModel(**config).to(dtype=getattr(torch, dtype.name))
    dstate = {k: torch.from_dlpack(v.contiguous()).to(getattr(torch, dtype.name))
              for k, v in K.sai_to_diffusers(state, p).items()}
    missing, unexpected = theirs.load_state_dict(dstate, strict=True)
    assert not missing and not unexpected
    return ours, theirs


def run_pair(ours, theirs, p, dtype, height, width, n_ctx, batch=1, seed=1):
    rng = np.random.default_rng(seed)
    arrays = dict(x=rng.standard_normal((batch, 16, height // 8, width // 8)),
                  y=rng.standard_normal((batch, p.pooled_in_dim)),
                  ctx=rng.standard_normal((batch, n_ctx, p.context_in_dim)))
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    t = np.linspace(913.4, 212.5, batch).astype(np.float32)
    f = {k: flame.tensor(v, dtype=dtype, device="cuda") for k, v in arrays.items()}
    with flame.no_grad():
        out = ours(f["x"], flame.tensor(t, device="cuda"), f["y"], f["ctx"]).float().numpy()
    tdtype = getattr(torch, dtype.name)
    tt = {k: torch.tensor(v, device="cuda").to(tdtype) for k, v in arrays.items()}
    with torch.no_grad():
        ref = theirs(hidden_states=tt["x"], encoder_hidden_states=tt["ctx"], pooled_projections=tt["y"],
                     timestep=torch.tensor(t, device="cuda"), return_dict=False)[0]
    return out, ref.float().cpu().numpy()


def test_tiny_mmdit_x_matches_diffusers_in_float32():
    p = sd3_params("sd3.5-tiny")
    ours, theirs = build_pair(p, flame.float32)
    out, ref = run_pair(ours, theirs, p, flame.float32, 64, 48, 7, batch=2)
    assert out.shape == ref.shape == (2, 16, 8, 6) and np.abs(ref).mean() > 1e-3
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("preset,dual", [("sd3.5-large", ()), ("sd3.5-medium", (0,))])
def test_released_width_blocks_match_diffusers_in_bfloat16(preset, dual):
    """Real widths (Large H 2432 / 38 heads, Medium H 1536 / 24 heads with a dual-attention block; heads of 64, QK
    RMS-norm, the 4096-wide context and 2048 pooled), two joint blocks, a 1024 x 768 image with 333 context tokens."""
    p = sd3_params(preset).replace(depth=2, dual_attention_layers=dual)
    ours, theirs = build_pair(p, flame.bfloat16)
    out, ref = run_pair(ours, theirs, p, flame.bfloat16, 1024, 768, 333)
    assert out.shape == ref.shape == (1, 16, 128, 96)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 2e-2, f"relative difference to diffusers {err:.3e}"
