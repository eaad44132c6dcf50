"""The trainer's captured region (Trainer._forward_backward) of every family steps without anything a CUDA graph
capture refuses -- checked on the CPU by capture_guard.no_host_sync (the GPU suite only sees a graph that was never
captured: SD3.5's dual-attention blocks split their modulation into 9 vectors, whose gradients CuPy concatenated
through a host-side address table, and the capture fell back to eager steps; flame_core's cat now joins more than 8
pieces one slice at a time)."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.flux.layers import modulation_chunks
from flame_models.training.trainer import Trainer

from .capture_guard import HostSyncError, guarded_step, no_host_sync
from .conftest import draw_images, image_config
from .test_sd_families import SD3_MODEL, sdxl_model  # noqa: F401  (the module fixture)


def test_the_guard_refuses_what_a_capture_refuses_and_restores_everything():
    t = flame.randn(4, 3, device="cpu")  # (the guard sees NumPy's concatenate: the cpu, also under FLAME_DEVICE)
    with no_host_sync():
        y = (t * 2 + 1).sum(0)                             # device work is fine
        flame.cat([t] * 8, dim=0)
        flame.cat([t] * 9, dim=0), flame.stack([t] * 9)    # flame_core joins more than 8 slice by slice
        flame.tensor(t)                                     # a device copy
        for bad in (lambda: t[0, 0].item(), lambda: t.numpy(),
                    lambda: float(t.sum()), lambda: bool(t.sum() > 0), lambda: t.tolist(),
                    lambda: flame.tensor(np.ones(3, np.float32), device="cpu"), lambda: flame.randn(2, device="cpu"),
                    lambda: np.concatenate([t.detach().numpy()] * 9), lambda: np.stack([np.zeros(2)] * 9)):
            with pytest.raises(HostSyncError, match="a CUDA graph captures"):
                bad()
    assert y.shape == (3,) and t.numpy().shape == (4, 3)
    assert float(flame.cat([t] * 9).sum()) == pytest.approx(9 * float(t.sum()), rel=1e-5)
    assert flame.randn(2, device="cpu").shape == (2,) and flame.tensor(np.ones(3), device="cpu").shape == (3,)


def test_a_split_into_more_than_8_pieces_backpropagates_under_the_guard():
    w = flame.randn(2, 9 * 4, requires_grad=True, device="cpu")
    with no_host_sync():
        parts = modulation_chunks(w, 9)
        sum((p * (i + 1)).sum() for i, p in enumerate(parts)).backward()     # the backward joins 9 gradients
    assert [tuple(p.shape) for p in parts] == [(2, 4)] * 9
    np.testing.assert_array_equal(w.grad.numpy(), np.repeat(np.arange(1, 10, dtype=np.float32), 4)[None].repeat(2, 0))
    np.testing.assert_array_equal(np.concatenate([p.detach().numpy() for p in parts], -1), w.detach().numpy())


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl"])
def test_every_familys_captured_region_has_no_host_sync(tmp_path, tiny_model, sdxl_model, arch):  # noqa: F811
    # bf16 with autocast, as on the GPU; SDXL with the DDPM options whose tables live on the device (min-SNR,
    # v-prediction, noise offset); SD3's fixture has MMDiT-X dual-attention blocks (9 modulation vectors)
    images = draw_images(tmp_path / "images", 2, 2)
    model = {"flux": tiny_model, "sd3": SD3_MODEL, "sdxl": sdxl_model}[arch]
    top = {} if arch == "flux" else {"model": {"arch": arch, **({"t5_max_length": None} if arch == "sdxl" else {})}}
    train = {"dtype": "bf16"}
    if arch == "sdxl":
        train.update(min_snr_gamma=5.0, noise_offset=0.05, prediction_type="v_prediction")
    if arch == "sd3":
        train.update(weighting_scheme="cosmap")
    cfg = image_config(tmp_path, arch, model, images, steps=3, train=train, **top)
    cfg.model.dtype = "bf16"
    tr = Trainer(cfg, verbose=False).setup()
    loss, _, _ = guarded_step(tr)
    assert np.isfinite(loss) and tr.step == 3


class _FailingCapture:
    """A GraphedFunction stand-in (the cpu has no graphs): eager for `warmup` calls, then the capture raises."""

    def __init__(self, fn, warmup=2):
        self.fn, self.warmup, self.calls, self.graph = fn, warmup, 0, None

    def __call__(self, *args):
        self.calls += 1
        if self.calls <= self.warmup:
            return self.fn(*args)
        raise RuntimeError("cudaErrorCapturedEvent: operation not permitted on an event last recorded in a "
                           "capturing stream\n(second line)")

    def reset(self):
        self.calls = 0


def test_a_failed_capture_trains_on_eagerly_and_keeps_why(tmp_path, monkeypatch, capsys):
    from flame_models.training import graphs

    from .conftest import tiny_config
    monkeypatch.setattr(graphs, "graphed", _FailingCapture)
    runs = {}
    for fail in (False, True):
        tr = Trainer(tiny_config(tmp_path, f"f{fail}", steps=4), verbose=fail).setup()
        if fail:
            tr.graphed = graphs.StepGraphs(tr._forward_backward, warmup=2)  # as on cuda
        runs[fail] = ([tr.train_step()[0] for _ in range(4)], tr)
    tr = runs[True][1]
    assert not tr.graphed.enabled and tr.graphed.captured == 0
    assert tr.graphed.failure == "RuntimeError: cudaErrorCapturedEvent: operation not permitted on an event last " \
                                 "recorded in a capturing stream"
    assert f"CUDA graph capture failed ({tr.graphed.failure}); training continues eagerly" in capsys.readouterr().out
    np.testing.assert_array_equal(runs[True][0], runs[False][0])  # the failed step ran eagerly: the same numbers
