"""LoRAs on the frozen base on cuda: merged on the GPU as the weights are read (bf16, fp8 storage, blocks streamed
under max_gpu_memory), the merge the generators make; the assistant's previews through the real sampler on a
graphed, streamed run."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_models.flux import load_flux
from flame_models.pipeline.loras import apply_loras
from flame_models.training.trainer import Trainer
from flame_nn.offload import quantize_linear_weights_

from .test_base_loras import ADAPTED, _config, _lora

pytestmark = pytest.mark.gpu


def test_a_parts_merge_on_the_gpu_is_numpys():
    import cupy
    g = np.random.default_rng(0)
    for kind, tensors in [("lora", {"lora_down.weight": g.standard_normal((4, 24)),
                                    "lora_up.weight": g.standard_normal((40, 4))}),
                          ("lokr", {"lokr_w1": g.standard_normal((4, 4)), "lokr_w2": g.standard_normal((10, 6))}),
                          ("dora", {"lora_down.weight": g.standard_normal((4, 24)),
                                    "lora_up.weight": g.standard_normal((40, 4)),
                                    "dora_scale": np.abs(g.standard_normal((40, 1))) + 0.5})]:
        p = A.formats.AdapterPart(kind, {k: v.astype(np.float32) for k, v in tensors.items()}, alpha=2.0)
        w = g.standard_normal(p.shape).astype(np.float32)
        want = p.merged_weight(w)
        got = p.merged_weight(cupy.asarray(w), cupy, np.float32)
        assert isinstance(got, cupy.ndarray) and got.dtype == np.float32
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-5, atol=1e-5, err_msg=kind)


def _cuda(c, budget=None, quantize=False):
    c.device, c.train.dtype, c.model.dtype, c.max_gpu_memory = "cuda", "bf16", "bf16", budget
    c.model.quantize = quantize
    return c


def _host(model, n):
    m = model.get_submodule(n)
    w = m.dequantized_weight() if hasattr(m, "dequantized_weight") else m.weight
    return w.detach().float().cpu().numpy()


def test_bf16_merge_on_read_is_the_generators_merge(tmp_path, flux_file):
    lora = _lora(tmp_path / "l.safetensors", flux_file, fmt="peft")
    tr = Trainer(_cuda(_config(tmp_path, "bf16", flux_file, lora_path=lora)), verbose=False).setup()
    want = apply_loras(load_flux(flux_file, dtype=flame.bfloat16, device="cuda"), [(lora, 1.0)])
    for n in ADAPTED:
        assert tr.model.get_submodule(n).weight.device.type == "cuda"
        np.testing.assert_allclose(_host(tr.model, n), _host(want, n), rtol=1e-2, atol=1e-3, err_msg=n)


@pytest.mark.gpu_exclusive   # a max_gpu_memory budget: other processes' memory counts against it
@pytest.mark.parametrize("quantize", [False, True])
def test_streamed_graphed_runs_merge_and_preview_without_the_assistant(tmp_path, flux_file, quantize):
    """Under max_gpu_memory (blocks streamed from host memory; fp8 with quantize) the assistant is merged as the
    blocks are read -- the resident run's weights --, the step is captured, and the previews run through the
    sampler with the assistant's adapters at -1, gone after."""
    assistant = _lora(tmp_path / "a.safetensors", flux_file)
    runs = {}
    for budget in (None, "8GiB"):
        c = _cuda(_config(tmp_path, f"s{budget}{quantize}", flux_file, steps=6, assistant_lora_path=assistant),
                  budget, quantize)
        c.sample.sample_every, c.sample.sample_steps = 3, 2
        tr = Trainer(c, verbose=False).setup()
        captured, reset = [], tr.graphed.reset

        def spy(reset=reset, tr=tr, captured=captured):   # (a budget's previews release the step's graph)
            captured.append(tr.graphed.graph is not None)
            reset()
        tr.graphed.reset = spy
        runs[budget] = (tr, np.array(tr.train()["losses"]))
        assert np.isfinite(runs[budget][1]).all()
        assert tr.graphed.enabled and tr.graphed.failure is None, tr.graphed.why
        assert tr.graphed.graph is not None or any(captured)          # it captured
        assert A.adapter_names(tr.model) == ["default"]
        assert (tmp_path / c.name / "samples" / "step_000003.safetensors").exists()
    np.testing.assert_allclose(runs["8GiB"][1], runs[None][1], rtol=2e-2)
    # the resident run's frozen weights: the generators' merge (then fp8 storage's rounding with quantize)
    merged = apply_loras(load_flux(flux_file, dtype=flame.bfloat16, device="cuda"), [(assistant, 1.0)])
    merged.requires_grad_(False)
    if quantize:
        for s in ("double_blocks", "single_blocks"):
            quantize_linear_weights_(merged.get_submodule(s))
    for n in ADAPTED:
        got, want = _host(runs[None][0].model, n), _host(merged, n)
        assert (np.abs(got - want) <= (0.07 if quantize else 1e-2) * np.abs(want) + 1e-3).all(), n


def test_a_text_encoder_part_on_cuda_with_t5_in_fp8_and_refused_for_a_streamed_t5(tmp_path, tiny_model):
    """model.lora_path's CLIP-L and T5 parts on cuda with T5 in fp8 storage (its part kept as adapters beside the
    fp8 weights): the cached embeddings are the generator's with the same file; under a budget that streams T5 the
    T5 part is a ConfigError before anything is cached."""
    from flame_models.flux import pipeline as FP
    from flame_models.training.config import ConfigError

    from .conftest import draw_images, image_config
    from .test_base_loras_text import _cached, _caption, _flux_parts, te_lora_file
    images = draw_images(tmp_path / "images", n_concept=2, n_other=1)
    files = FP.find_flux_files(tiny_model)
    with FP.load_text_encoders(files, dtype=flame.float32, device="cpu") as enc:
        path = te_lora_file(str(tmp_path / "te.safetensors"), _flux_parts(enc), "kohya", seed=5)
    cfg = _cuda(image_config(tmp_path, "te_cuda", tiny_model, images, steps=2,
                             model={"lora_path": path, "quantize_te": True}))
    tr = Trainer(cfg, verbose=False).setup()
    caption = _caption(images)
    got = _cached(tr, caption)
    with FP.load_text_encoders(files, dtype=flame.bfloat16, device="cuda", t5_quantize="fp8", max_length=8,
                               loras=[(path, 1.0)]) as ref:
        assert A.adapter_names(ref.t5)                               # (fp8 storage: beside the weights)
        want = {k: v.float().cpu().numpy()[0] for k, v in ref.encode([caption]).items()}
    for k in want:
        scale = np.abs(want[k]).max()
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=2e-2 * scale, err_msg=k)
    assert np.isfinite(tr.train()["losses"]).all()
    streamed = _cuda(image_config(tmp_path, "te_stream", tiny_model, images, steps=2, model={"lora_path": path}),
                     budget="1GiB")
    tr = Trainer(streamed, verbose=False)
    with pytest.raises(ConfigError, match=r"holds T5EncoderModel adapters \(te3: .*streams from host memory under "
                                          r"max_gpu_memory"):
        tr.setup()
    assert tr.prepared is None
