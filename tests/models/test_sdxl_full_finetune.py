"""What a full fine-tune of the SDXL UNet relies on, against diffusers + torch (tests/fixtures/
make_full_finetune_fixtures.py): the gradient of EVERY weight -- norms, biases, embeddings, convolutions, not only
the attention Linears a LoRA adapts -- for a fixed loss, and every weight after two AdamW steps on it."""
import os

import numpy as np
import pytest
from sdxl_fixtures import DIFFUSERS_DIR, FIXTURES, assert_close, io, t, unet_inputs

import flame_core as flame
import flame_nn
from flame_core.io import load_file
from flame_models.sdxl import load_unet


@pytest.fixture(scope="module")
def golden():
    return {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "full_finetune.safetensors")).items()}


def _loss(unet, ref, y):
    x, ts, ctx, _ = unet_inputs(ref, device="cpu")
    f64 = flame.float64
    return (unet(x.to(f64), ts, ctx.to(f64), y) * t(ref["loss_weight"], "cpu").to(f64)).sum()


def test_every_weights_gradient_and_two_adamw_steps_match_torch(golden):
    ref = io()
    # float64, as the fixture's torch model: Adam's first steps take the gradient's sign where it is near zero, so a
    # float32 model's rounding would move such a weight by up to 2 x lr
    unet = load_unet(DIFFUSERS_DIR, dtype=flame.float64, device="cpu", progress=False).train()
    unet.requires_grad_(True)
    named = dict(unet.named_parameters())
    assert {k[len("grad."):] for k in golden if k.startswith("grad.")} == set(named)   # every weight, no other
    opt = flame_nn.optim.AdamW(list(named.values()), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(2):
        opt.zero_grad()
        _loss(unet, ref, t(golden["y"], "cpu")).backward()
        if step == 0:
            for k, p in named.items():
                assert p.grad is not None, k
                assert_close(p.grad, golden["grad." + k], 1e-5, f"grad {k}")
        opt.step()
    # Adam's first steps move a weight by ~lr times the sign of its gradient, so where a gradient is within the
    # two models' rounding of zero (the time embedding's sinusoids are float32 in diffusers) the step may differ by
    # up to 2 lr per step; where it is clear of zero (above 1e-3 of the tensor's largest) to 1e-3 of lr
    steady = 0
    for k, p in named.items():
        got, want, g = p.detach().numpy(), golden["step2." + k], np.abs(golden["grad." + k])
        assert np.abs(got - want).max() <= 4 * 1e-3, k
        clear = g > 1e-3 * g.max()
        np.testing.assert_allclose(got[clear], want[clear], rtol=0, atol=1e-6, err_msg=k)
        steady += int(clear.sum())
    assert steady > 0.95 * sum(p.numel() for p in named.values())
