"""What a full fine-tune of Flux relies on, against diffusers + torch (tests/fixtures/make_full_finetune_fixtures.py):
the gradient of EVERY weight of a FluxTransformer2DModel of flux-tiny's widths (1 double + 1 single block, guidance
embedding; random weights, every norm scale and projection included) for a fixed loss, in float64 -- FLAME's
fused projections' gradients split into diffusers' names (keys.bfl_to_diffusers) and compared one by one."""
import os

import numpy as np

import flame_core as flame
from flame_core.io import load_file
from flame_models.flux import keys as K
from flame_models.flux import load_flux

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "flux_full_finetune")


def test_every_weights_gradient_matches_diffusers():
    ref = {k: v.numpy() for k, v in load_file(os.path.join(HERE, "golden.safetensors")).items()}
    model = load_flux(os.path.join(HERE, "transformer"), dtype=flame.float64, device="cpu")
    model.train().requires_grad_(True)

    def t(name, batch=False):
        a = ref[name][None] if batch else ref[name]
        return flame.tensor(np.ascontiguousarray(a, dtype=np.float64), device="cpu")
    out = model(img=t("img"), img_ids=t("img_ids", True), txt=t("txt"), txt_ids=t("txt_ids", True),
                timesteps=t("t"), y=t("y"), guidance=t("guidance"))
    scale = np.abs(ref["out"]).max()
    assert np.abs(out.detach().numpy() - ref["out"]).max() <= 1e-5 * scale
    (out * t("loss_weight")).sum().backward()
    grads = K.bfl_to_diffusers({k: p.grad for k, p in model.named_parameters()}, model.params)
    want = {k[len("grad."):]: v for k, v in ref.items() if k.startswith("grad.")}
    assert set(grads) == set(want)                                   # every weight, in diffusers' names
    worst = {}
    for k, w in want.items():
        g = grads[k].detach().numpy()
        s = np.abs(w).max()
        assert s > 0, k                                              # every weight has a gradient to compare
        worst[k] = np.abs(g - w).max() / s
    # diffusers computes the timestep and guidance sinusoids in float32 even in a float64 model: at 1000 t = 375 and
    # 1000 g = 3500 their arguments carry ~1e-4 of rounding, which the embedders' first weights' gradients (the
    # sinusoids times the upstream gradient) inherit; every other gradient agrees to ~3e-5 of its tensor's scale. A
    # wrong rule would be off by its whole size.
    embedders = {k: v for k, v in worst.items() if "_embedder.linear_1" in k}
    assert max(embedders.values()) <= 5e-4, embedders
    rest = {k: v for k, v in worst.items() if k not in embedders}
    assert max(rest.values()) <= 1e-4, sorted(rest.items(), key=lambda kv: -kv[1])[:3]
