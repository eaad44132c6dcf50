"""kohya's max-norm regularisation (--scale_weight_norms) of LoRA and LoCon adapters, against kohya's rule computed
in NumPy float64 from the full ΔW (norm floored at max/2, ratio = min(norm, max) / norm, A and B each scaled by its
square root; the scaled count, mean and max of the norms after scaling)."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
import flame_nn.adapters as A
from flame_nn.adapters.max_norm import MaxNorm


def _np(t):
    return t.detach().cpu().numpy().astype(np.float64)


def _delta_norm(ad):
    a, b = _np(ad.lora_A), _np(ad.lora_B)
    return np.linalg.norm(b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1)) * ad.scale


def _adapters(device, scales=(0.05, 0.45, 1.0, 3.0)):
    flame.manual_seed(0)
    net = flame_nn.Sequential(flame_nn.Linear(12, 10, device=device), flame_nn.Linear(10, 8, device=device),
                              flame_nn.Linear(8, 8, device=device), flame_nn.Conv2d(3, 5, 3, device=device))
    A.inject_adapters(net, ["0", "1", "2"], "lora", rank=4, alpha=2.0)
    A.inject_adapters(net, ["3"], "lora", rank=3, alpha=3.0, skip_adapted=True)
    ads = [ad for _, _, ad in A.adapter_modules(net)]
    for ad, s in zip(ads, scales):
        with flame.no_grad():
            ad.lora_B.copy_(flame.randn(*ad.lora_B.shape, device=device) * s)
    return ads


def test_the_step_follows_kohyas_rule(device):
    ads = _adapters(device)
    m = 1.0
    before = [(_np(ad.lora_A), _np(ad.lora_B)) for ad in ads]
    norms = np.array([_delta_norm(ad) for ad in ads])
    assert (norms > m).any() and (norms < m / 2).any() and ((norms > m / 2) & (norms < m)).any()
    reg = MaxNorm(ads, m)
    assert reg.stats() is None
    reg.apply()
    floored = np.maximum(norms, m / 2)
    ratio = np.minimum(floored, m) / floored
    for ad, (a, b), r in zip(ads, before, ratio):
        np.testing.assert_allclose(_np(ad.lora_A), a * np.sqrt(r), rtol=1e-6)
        np.testing.assert_allclose(_np(ad.lora_B), b * np.sqrt(r), rtol=1e-6)
    after = np.array([_delta_norm(ad) for ad in ads])
    np.testing.assert_allclose(after, np.minimum(norms, m), rtol=1e-5)
    k, mean, top = reg.stats()
    assert k == int((ratio < 1).sum()) and k >= 1
    assert mean == pytest.approx((norms * ratio).mean(), rel=1e-5) and top == pytest.approx(m, rel=1e-5)


def test_only_lora_and_locon_adapters():
    net = flame_nn.Sequential(flame_nn.Linear(8, 8))
    A.inject_adapters(net, ["0"], "dora", rank=2)
    with pytest.raises(A.AdapterError, match="scales LoRA / LoCon adapters"):
        MaxNorm([ad for _, _, ad in A.adapter_modules(net)], 1.0)
    with pytest.raises(A.AdapterError, match="max_norm must be > 0"):
        MaxNorm([], 0.0)


@pytest.mark.gpu
def test_replayed_as_a_cuda_graph_it_reads_the_adapters_as_they_are():
    """The trainer replays apply() as a CUDA graph: each replay works on the adapters' current values (written in
    place by the optimizer), and reports that replay's figures."""
    ads = _adapters("cuda")
    reg = MaxNorm(ads, 1.0)
    run = flame.cuda.graphed(reg.apply, warmup=1)
    for k in range(4):   # eager, capture, replays
        with flame.no_grad():
            for ad, s in zip(ads, (0.05, 0.45, 1.0, 3.0)):
                ad.lora_B.copy_(flame.randn(*ad.lora_B.shape, device="cuda") * s * (k + 1))
        norms = np.array([_delta_norm(ad) for ad in ads])
        run()
        np.testing.assert_allclose([_delta_norm(ad) for ad in ads], np.minimum(norms, 1.0), rtol=1e-4)
        floored = np.maximum(norms, 0.5)
        assert reg.stats()[0] == int((np.minimum(floored, 1.0) / floored < 1).sum())
    assert run.graph is not None
