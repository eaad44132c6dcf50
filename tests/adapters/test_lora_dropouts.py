"""kohya's rank_dropout and module_dropout (networks/lora.py) on LoRA, DoRA and LoCon adapters, in training only:
the output is the reference computed with the same draws (flame.rand from the default generator: a per-sample mask
of the ranks scaled by 1/(1-p); one keep-or-skip draw for the whole adapter), eval mode draws nothing, the kinds
without them refuse them."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
import flame_nn.adapters as A


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _linear(device, **drops):
    flame.manual_seed(0)
    lin = flame_nn.Linear(12, 10, dtype=flame.float64, device=device)
    model = flame_nn.Sequential(lin)
    A.inject_adapters(model, ["0"], "lora", rank=4, alpha=2.0, dtype=flame.float64, **drops)
    ad = A.adapter_modules(model)[0][2]
    with flame.no_grad():
        ad.lora_B.copy_(flame.randn(10, 4, dtype=flame.float64, device=device))
    return model, lin, ad


def test_rank_dropout_masks_each_samples_ranks_and_rescales(device):
    model, lin, ad = _linear(device, rank_dropout=0.5)
    x = flame.randn(3, 5, 12, dtype=flame.float64, device=device)
    flame.manual_seed(11)
    y = _np(model(x))
    flame.manual_seed(11)
    mask = _np(flame.rand(3, 1, 4, device=device)) >= 0.5               # the draw the adapter made
    base = _np(x) @ _np(lin.weight).T + _np(lin.bias)
    h = (_np(x) @ _np(ad.lora_A).T) * ad.scale * mask * 2.0
    np.testing.assert_allclose(y, base + h @ _np(ad.lora_B).T, rtol=1e-12, atol=1e-12)
    assert 0 < mask.sum() < mask.size                                     # (some kept, some dropped: a real test)
    model.eval()                                                          # eval: no dropout, nothing drawn
    np.testing.assert_allclose(_np(model(x)), base + (_np(x) @ _np(ad.lora_A).T) * ad.scale @ _np(ad.lora_B).T,
                               rtol=1e-12, atol=1e-12)


def _module_draws(model, x, device, p=0.5, seeds=12):
    """[(output, kept?)] of `model(x)` over several seeds, each call's keep-or-skip draw redrawn from the same seed;
    both outcomes must occur (else the test would check only one)."""
    out = []
    for seed in range(seeds):
        flame.manual_seed(seed)
        y = _np(model(x))
        flame.manual_seed(seed)
        out.append((y, bool(_np(flame.rand(1, device=device))[0] >= p)))
    assert {k for _, k in out} == {True, False}
    return out


def test_module_dropout_skips_the_whole_adapter_for_a_call(device):
    model, lin, ad = _linear(device, module_dropout=0.5)
    x = flame.randn(2, 12, dtype=flame.float64, device=device)
    base = _np(x) @ _np(lin.weight).T + _np(lin.bias)
    full = base + (_np(x) @ _np(ad.lora_A).T) * ad.scale @ _np(ad.lora_B).T
    for y, keep in _module_draws(model, x, device):
        np.testing.assert_allclose(y, full if keep else base, rtol=1e-12, atol=1e-12)


def test_dropped_ranks_get_no_gradient(device):
    model, _, ad = _linear(device, rank_dropout=0.5)
    x = flame.randn(1, 6, 12, dtype=flame.float64, device=device)        # one sample: one mask for all its tokens
    flame.manual_seed(3)
    model(x).sum().backward()
    flame.manual_seed(3)
    mask = (_np(flame.rand(1, 1, 4, device=device)) >= 0.5).reshape(-1)
    g = _np(ad.lora_A.grad)
    assert 0 < mask.sum() < 4
    assert np.all(g[~mask] == 0) and np.all(np.abs(g[mask]).sum(axis=1) > 0)


def test_dora_skipped_is_the_base_and_locon_masks_its_channels(device):
    flame.manual_seed(0)
    lin = flame_nn.Linear(12, 10, dtype=flame.float64, device=device)
    model = flame_nn.Sequential(lin)
    A.inject_adapters(model, ["0"], "dora", rank=4, alpha=2.0, dtype=flame.float64, module_dropout=0.5)
    ad = A.adapter_modules(model)[0][2]
    with flame.no_grad():
        ad.lora_B.copy_(flame.randn(10, 4, dtype=flame.float64, device=device))
    x = flame.randn(2, 12, dtype=flame.float64, device=device)
    base = _np(x) @ _np(lin.weight).T + _np(lin.bias)
    for y, keep in _module_draws(model, x, device):
        if not keep:
            np.testing.assert_allclose(y, base, rtol=1e-12, atol=1e-12)
        else:
            assert np.abs(y - base).max() > 1e-3
    # LoCon: the mask is (N, r, 1, 1)
    conv = flame_nn.Conv2d(3, 5, 3, padding=1, dtype=flame.float64, device=device)
    net = flame_nn.Sequential(conv)
    A.inject_adapters(net, ["0"], "lora", rank=4, alpha=4.0, dtype=flame.float64, rank_dropout=0.25)
    cad = A.adapter_modules(net)[0][2]
    with flame.no_grad():
        cad.lora_B.copy_(flame.randn(5, 4, 1, 1, dtype=flame.float64, device=device))
    xc = flame.randn(2, 3, 6, 6, dtype=flame.float64, device=device)
    flame.manual_seed(5)
    y = _np(net(xc))
    flame.manual_seed(5)
    mask = (_np(flame.rand(2, 4, 1, 1, device=device)) >= 0.25) / 0.75
    net.eval()
    with flame.no_grad():
        h = _np(flame_nn.functional.conv2d(xc, cad.lora_A, None, 1, 1)) * cad.scale * mask
        base_c = _np(flame_nn.functional.conv2d(xc, conv.weight, conv.bias, 1, 1))
    np.testing.assert_allclose(y, base_c + np.einsum("or,nrhw->nohw", _np(cad.lora_B)[:, :, 0, 0], h),
                               rtol=1e-10, atol=1e-12)


def test_kinds_without_them_and_bad_rates_are_refused(device):
    model = flame_nn.Sequential(flame_nn.Linear(12, 12, device=device))
    with pytest.raises(A.AdapterError, match="rank_dropout / module_dropout are LoRA's"):
        A.inject_adapters(model, ["0"], "lokr", rank=2, rank_dropout=0.1)
    with pytest.raises(A.AdapterError, match="module_dropout must be in"):
        A.inject_adapters(model, ["0"], "lora", rank=2, module_dropout=1.0)


def test_a_checkpointed_forward_recomputes_the_same_draws(device):
    """Under gradient checkpointing the recompute replays the forward's random streams (flame_core.checkpoint's
    preserve_rng_state): the gradients equal those of the plain forward with the same draws."""
    from flame_core.checkpoint import checkpoint
    model, _, ad = _linear(device, rank_dropout=0.5, module_dropout=0.3)
    x = flame.randn(3, 5, 12, dtype=flame.float64, device=device)

    def grads_of(seed, ckpt):
        for p in (ad.lora_A, ad.lora_B):
            p.grad = None
        flame.manual_seed(seed)
        (checkpoint(model, x) if ckpt else model(x)).sum().backward()
        return [_np(ad.lora_A.grad), _np(ad.lora_B.grad)]
    # a seed whose module draw keeps the adapter (the gradients are not all zero; each device draws its own stream)
    seed = next(s for s in range(64) if np.abs(grads_of(s, False)[1]).max() > 0)
    grads = [grads_of(seed, False), grads_of(seed, True)]
    assert np.abs(grads[0][1]).max() > 0
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
