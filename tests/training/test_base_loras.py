"""LoRAs on the frozen base (ai-toolkit's model.lora_path, assistant_lora_path, inference_lora_path): merged into the
weights as the checkpoint is read -- the same weights as merging the file at sampling time (pipeline.loras), in fp8
storage too --; the assistant taken back out of previews at weight -1 and the inference LoRA added to them, neither in
the LoRA the run writes; every problem a ConfigError naming the setting before anything is built (tiny Flux, cpu)."""
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_core import io
from flame_models.flux import Flux, load_flux
from flame_models.pipeline.loras import apply_loras
from flame_models.training import samples as samples_module
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.trainer import Trainer
from flame_nn.offload import is_fp8_linear, quantize_linear_weights_

from .conftest import tiny_config

ADAPTED = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1",
           "single_blocks.1.linear2"]


def _lora(path, base_file, kind="lora", fmt="kohya", seed=0, scale=0.1, modules=ADAPTED):
    """A LoRA file of `kind` on `modules` of the tiny Flux in `base_file`, every factor random (a non-zero change)."""
    m = load_flux(base_file, device="cpu")
    A.inject_adapters(m, modules, kind=kind, rank=4, alpha=2)
    g = np.random.default_rng(seed)
    for p in A.adapter_parameters(m):
        p.data = flame.tensor(g.standard_normal(tuple(p.shape)).astype(np.float32) * scale, device="cpu")
    A.save_adapters(m, str(path), fmt)
    return str(path)


def _merged(base_file, loras):
    """The tiny Flux of `base_file` with `loras` merged as the generators merge them (pipeline.loras)."""
    return apply_loras(load_flux(base_file, device="cpu"), [(p, 1.0) for p in loras])


def _config(tmp_path, name, base_file, steps=3, **model):
    return tiny_config(tmp_path, name, steps=steps, drop=["model.size"], model={"name_or_path": base_file, **model})


def _weights(model, names=ADAPTED):
    return {n: model.get_submodule(n).weight.detach().float().numpy() for n in names}


def _out(model, module, x):
    with flame.no_grad():
        return model.get_submodule(module)(x).numpy()


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_lora_path_is_merged_as_the_generators_merge_it(tmp_path, flux_file, fmt):
    """The run's base weights are the file's and the LoRA's merged (peft: diffusers names, to_q / to_k / to_v rows
    of the fused qkv); the layers it does not name are the file's bit for bit."""
    lora = _lora(tmp_path / f"l_{fmt}.safetensors", flux_file, fmt=fmt)
    tr = Trainer(_config(tmp_path, f"lp_{fmt}", flux_file, lora_path=lora), verbose=False).setup()
    want, base = _merged(flux_file, [lora]), load_flux(flux_file, device="cpu")
    got, ref, orig = _weights(tr.model), _weights(want), _weights(base)
    for n in ADAPTED:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-6, atol=1e-6, err_msg=n)
        assert np.abs(got[n] - orig[n]).max() > 1e-3, n           # the LoRA changed it
    other = "double_blocks.0.txt_attn.qkv"
    np.testing.assert_array_equal(_weights(tr.model, [other])[other], _weights(base, [other])[other])
    assert A.adapter_names(tr.model) == ["default"]               # merged: no adapter of its own
    assert np.isfinite(tr.train()["losses"]).all()


@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_other_kinds_merge_too(tmp_path, flux_file, kind):
    lora = _lora(tmp_path / f"{kind}.safetensors", flux_file, kind=kind)
    tr = Trainer(_config(tmp_path, f"k_{kind}", flux_file, lora_path=lora), verbose=False).setup()
    got, ref = _weights(tr.model), _weights(_merged(flux_file, [lora]))
    for n in ADAPTED:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_a_random_model_takes_the_merge_once_built(tmp_path, flux_file):
    """Without name_or_path (a random model) the file is merged into the built weights: the change is the file's."""
    lora = _lora(tmp_path / "l.safetensors", flux_file)
    plain = Trainer(tiny_config(tmp_path, "rnd0", steps=3), verbose=False).setup()
    tr = Trainer(tiny_config(tmp_path, "rnd1", steps=3, model={"lora_path": lora}), verbose=False).setup()
    modules = A.formats.load(lora, [n for n, _ in tr.model.named_modules()], name_map=tr.name_map)[0]
    for n in ADAPTED:
        w0 = plain.model.get_submodule(n).weight.detach().numpy().astype(np.float64)
        want = w0.copy()
        for p in modules[n]:
            lo, hi = p.rows or (0, w0.shape[0])
            want[lo:hi] = p.merged_weight(w0[lo:hi])
        np.testing.assert_allclose(tr.model.get_submodule(n).weight.detach().numpy(), want, rtol=1e-5, atol=1e-6)


def test_fp8_storage_quantises_the_merged_weight(tmp_path, flux_file):
    """model.quantize: each block weight is merged as it is read, then stored in fp8: the bytes and scales of
    quantising the merged weight (a merge after fp8 storage is impossible: its rows lack their scales)."""
    lora = _lora(tmp_path / "l.safetensors", flux_file)
    c = _config(tmp_path, "fp8", flux_file, lora_path=lora)
    c.model.quantize = True
    tr = Trainer(c, verbose=False).setup()
    want = _merged(flux_file, [lora]).requires_grad_(False)
    for s in ("double_blocks", "single_blocks"):
        quantize_linear_weights_(want.get_submodule(s))
    for n in ADAPTED:
        got, ref = tr.model.get_submodule(n), want.get_submodule(n)
        assert is_fp8_linear(got)
        np.testing.assert_allclose(got.dequantized_weight().float().numpy(), ref.dequantized_weight().float().numpy(),
                                   rtol=0, atol=0, err_msg=n)
    assert np.isfinite(tr.train()["losses"]).all()


def _capture_previews(monkeypatch, x, modules=ADAPTED):
    """Previews.run replaced by a probe: what each module outputs for `x` and the adapters attached while it runs."""
    seen = []

    def run(self, model, step, progress_file=None):
        seen.append(({n: _out(model, n, x[n]) for n in modules}, A.adapter_names(model)))
        return []
    monkeypatch.setattr(samples_module.Previews, "run", run)
    return seen


def _inputs(model, seed=3):
    g = np.random.default_rng(seed)
    return {n: flame.tensor(g.standard_normal((2, model.get_submodule(n).weight.shape[1])).astype(np.float32),
                         device="cpu") for n in ADAPTED}


def test_the_assistant_trains_merged_and_is_taken_out_of_previews(tmp_path, flux_file, monkeypatch):
    """assistant_lora_path: the training model is base + assistant; the previews see the base again (its adapters
    at weight -1 beside the merged weights) with the run's adapters, and are gone after; the LoRA written holds
    the run's adapters only."""
    assistant = _lora(tmp_path / "assistant.safetensors", flux_file, fmt="peft")
    c = _config(tmp_path, "assist", flux_file, steps=3, assistant_lora_path=assistant)
    c.sample.sample_every = 100
    tr = Trainer(c, verbose=False).setup()
    base, merged = load_flux(flux_file, device="cpu"), _merged(flux_file, [assistant])
    x = _inputs(base)
    for n in ADAPTED:   # training: the merged model (the run's adapters start at B = 0)
        np.testing.assert_allclose(_out(tr.model, n, x[n]), _out(merged, n, x[n]), rtol=1e-5, atol=1e-5)
    seen = _capture_previews(monkeypatch, x)
    tr.sample()
    (outs, names), = seen
    assert sorted(names) == ["base_lora_0", "default"]
    for n in ADAPTED:
        np.testing.assert_allclose(outs[n], _out(base, n, x[n]), rtol=1e-4, atol=1e-5, err_msg=n)
    assert A.adapter_names(tr.model) == ["default"]
    out = tr.train()
    keys = set(io.load_file(out["lora"]))
    plain = Trainer(_config(tmp_path, "plain", flux_file, steps=3), verbose=False).train()
    assert keys == set(io.load_file(plain["lora"]))                   # the run's adapters, nothing of the assistant


def test_the_inference_lora_is_in_previews_only(tmp_path, flux_file, monkeypatch):
    lora = _lora(tmp_path / "inference.safetensors", flux_file, kind="lokr")
    c = _config(tmp_path, "infer", flux_file, inference_lora_path=lora)
    tr = Trainer(c, verbose=False).setup()
    base, merged = load_flux(flux_file, device="cpu"), _merged(flux_file, [lora])
    x = _inputs(base)
    for n in ADAPTED:
        np.testing.assert_array_equal(_weights(tr.model, [n])[n], _weights(base, [n])[n])
    seen = _capture_previews(monkeypatch, x)
    tr.sample()
    (outs, names), = seen
    for n in ADAPTED:
        np.testing.assert_allclose(outs[n], _out(merged, n, x[n]), rtol=1e-4, atol=1e-5, err_msg=n)
    assert A.adapter_names(tr.model) == ["default"]


def test_previews_sample_with_the_assistant_taken_out(tmp_path, flux_file):
    """A real preview (the sampler, the dataset items' conditioning) with an assistant and an inference LoRA."""
    assistant = _lora(tmp_path / "a.safetensors", flux_file)
    lora = _lora(tmp_path / "i.safetensors", flux_file, seed=1)
    c = _config(tmp_path, "prev", flux_file, steps=3, assistant_lora_path=assistant, inference_lora_path=lora)
    c.sample.sample_every, c.sample.sample_steps = 2, 2
    out = Trainer(c, verbose=False).train()
    assert any(f.endswith(".safetensors") and "step_000002" in f
               for f in os.listdir(os.path.join(c.output_dir, "samples")))
    assert np.isfinite(out["losses"]).all()


def test_a_folder_is_read_as_ai_toolkit_reads_it(tmp_path, flux_file):
    folder = tmp_path / "adapter"
    folder.mkdir()
    _lora(folder / "pytorch_lora_weights.safetensors", flux_file, fmt="peft")
    tr = Trainer(_config(tmp_path, "folder", flux_file, lora_path=str(folder)), verbose=False).setup()
    assert np.abs(_weights(tr.model)[ADAPTED[0]] - _weights(load_flux(flux_file, device="cpu"))[ADAPTED[0]]).max() > 0


def _text_encoder_lora(path, base_file):
    lora = _lora(path, base_file)
    sd = dict(io.load_file(lora))
    sd["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = np.zeros((4, 8), np.float32)
    sd["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = np.zeros((8, 4), np.float32)
    io.save_file(sd, lora)
    return lora


@pytest.mark.parametrize("case, words", [
    ("dora assistant", r"model.assistant_lora_path .*: a DoRA adapter \(on double_blocks.0.img_attn.qkv\)"),
    ("text encoder", r"model.lora_path .*: holds text-encoder adapters \(keys such as lora_te1_.*\), but this run "
                     r"trains on precomputed samples"),
    ("other size", r"model.inference_lora_path .*: the adapter on .* is 4x4 but this Flux's Linear"),
    ("not a lora", r"model.lora_path .*: not a LoRA file"),
])
def test_bad_files_are_refused_naming_the_setting_before_anything_is_built(tmp_path, flux_file, case, words):
    setting, value = "lora_path", None
    if case == "dora assistant":
        setting, value = "assistant_lora_path", _lora(tmp_path / "d.safetensors", flux_file, kind="dora")
    elif case == "text encoder":
        value = _text_encoder_lora(tmp_path / "te.safetensors", flux_file)
    elif case == "other size":
        m = Flux("flux-tiny")
        A.inject_adapters(m, ["double_blocks.0.img_attn.qkv"], rank=4)
        sd = {k: v for k, v in A.formats.to_kohya(A.adapter_state(m)).items()}
        up = next(k for k in sd if k.endswith("lora_up.weight"))
        sd[up] = np.zeros((4, 4), np.float32)
        sd[up.replace("lora_up", "lora_down")] = np.zeros((4, 4), np.float32)
        value = str(tmp_path / "small.safetensors")
        io.save_file(sd, value)
        setting = "inference_lora_path"
    elif case == "not a lora":
        value = flux_file
    c = _config(tmp_path, "bad", flux_file, **{setting: value})
    tr = Trainer(c, verbose=False)
    with pytest.raises(ConfigError, match=words):
        tr.setup()
    assert tr.prepared is None and not hasattr(tr, "model")   # nothing cached or built


@pytest.mark.parametrize("case, words", [
    ("hub", r"model.assistant_lora_path ostris/FLUX.1-schnell-training-adapter: no such file or folder \(a Hugging "
            r"Face repo id\? FLAME does not download, and the cache at .*empty-hub does not hold it: `huggingface-cli "
            r"download ostris/FLUX.1-schnell-training-adapter` fills it, or give a local path\)"),
    ("missing", r"model.lora_path .*nothing.safetensors: no such file or folder$"),
    ("empty folder", r"model.inference_lora_path .*empty: a folder without pytorch_lora_weights.safetensors"),
])
def test_paths_that_name_no_file_are_config_errors(tmp_path, flux_file, case, words, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))   # (not the machine's own cache)
    (tmp_path / "empty").mkdir()
    setting, value = {"hub": ("assistant_lora_path", "ostris/FLUX.1-schnell-training-adapter"),
                      "missing": ("lora_path", str(tmp_path / "nothing.safetensors")),
                      "empty folder": ("inference_lora_path", str(tmp_path / "empty"))}[case]
    with pytest.raises(ConfigError, match=words):
        _config(tmp_path, "bad", flux_file, **{setting: value})


def test_config_errors(tmp_path, flux_file):
    lora = _lora(tmp_path / "l.safetensors", flux_file)
    synthetic = {"num_samples": 2, "height": 32, "width": 32, "text_length": 8}
    with pytest.raises(ConfigError, match=r"model.assistant_lora_path: previews of adapters beside the weights; a full "
                                          r"fine-tune trains the weights"):
        config_from_dict({"name": "f", "training_folder": str(tmp_path), "network": {"type": "full"},
                          "synthetic": synthetic, "model": {"size": "flux-tiny", "assistant_lora_path": lora}})
    with pytest.raises(ConfigError, match=r"model.lora_path: merged into the weights as they are read; a random "
                                          r"model's streamed blocks"):
        config_from_dict({"name": "f", "training_folder": str(tmp_path), "max_gpu_memory": "8GiB",
                          "synthetic": synthetic, "model": {"size": "flux-tiny", "lora_path": lora}})
    # a full fine-tune of base + LoRA
    full = config_from_dict({"name": "f", "training_folder": str(tmp_path), "network": {"type": "full"},
                             "synthetic": synthetic, "model": {"size": "flux-tiny", "lora_path": lora}})
    assert full.model.lora_path == lora


def test_ai_toolkits_schnell_example_reads(tmp_path):
    """ai-toolkit's train_lora_flux_schnell_24gb.yaml's model section: the assistant is a setting (the files are
    checked when the run reads them: its hub id is refused then, naming the file to fetch)."""
    c = config_from_dict({"job": "extension", "config": {"name": "schnell", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path), "device": "cpu",
        "datasets": [{"folder_path": str(tmp_path), "caption_ext": "txt", "resolution": [512, 768, 1024]}],
        "network": {"type": "lora", "linear": 16, "linear_alpha": 16},
        "train": {"steps": 10, "lr": 1e-4, "optimizer": "adamw8bit", "dtype": "bf16"},
        "model": {"name_or_path": "black-forest-labs/FLUX.1-schnell",
                  "assistant_lora_path": "ostris/FLUX.1-schnell-training-adapter", "is_flux": True,
                  "quantize": True}}]}}, check_files=False)
    assert c.model.assistant_lora_path == "ostris/FLUX.1-schnell-training-adapter"


def test_a_full_fine_tune_starts_from_the_merged_weights(tmp_path, flux_file):
    """network.type full with model.lora_path: the weights that train are the base's with the LoRA merged."""
    lora = _lora(tmp_path / "l.safetensors", flux_file)
    c = tiny_config(tmp_path, "full", steps=3, drop=["model.size", "network.linear", "network.linear_alpha",
                                                     "network.target", "save.format"],
                    network={"type": "full"}, model={"name_or_path": flux_file, "lora_path": lora})
    tr = Trainer(c, verbose=False).setup()
    got, ref = _weights(tr.model), _weights(_merged(flux_file, [lora]))
    for n in ADAPTED:
        assert tr.model.get_submodule(n).weight.requires_grad
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-6, atol=1e-6, err_msg=n)
    assert np.isfinite(tr.train()["losses"]).all()


def test_an_sdxl_locon_file_merges_into_convolutions_and_linears(tmp_path):
    """SDXL from its diffusers folder with a LoCon file (adapters on 3x3 and 1x1 convolutions and on Linears) as
    model.lora_path: every adapted weight is the base's with the file's change (float64 reference)."""
    from sdxl_tiny import sdxl_tiny_folder

    from . import test_sd_families as fam_tests
    from .conftest import draw_images
    model = sdxl_tiny_folder(tmp_path / "sdxl-tiny")
    images = draw_images(tmp_path / "images", n_concept=2, n_other=1)
    first = fam_tests.sdxl_config(tmp_path, "locon", model, images, steps=3,
                                  network={"conv": 2, "conv_alpha": 1, "target": "attention"})
    lora = Trainer(first, verbose=False).train()["lora"]
    plain = Trainer(fam_tests.sdxl_config(tmp_path, "plain", model, images, steps=3), verbose=False).setup()
    tr = Trainer(fam_tests.sdxl_config(tmp_path, "merged", model, images, steps=3, model={"lora_path": lora}),
                 verbose=False).setup()
    modules = A.formats.load(lora, [n for n, _ in tr.model.named_modules()], name_map=tr.name_map)[0]
    convs = [n for n in modules if tr.model.get_submodule(n).weight.ndim == 4]
    assert convs and len(convs) < len(modules)
    for n, parts in modules.items():
        w0 = plain.model.get_submodule(n).weight.detach().numpy().astype(np.float64)
        want = w0.copy()
        for p in parts:
            lo, hi = p.rows or (0, w0.shape[0])
            want[lo:hi] = p.merged_weight(w0[lo:hi])
        assert np.abs(want - w0).max() > 0, n
        np.testing.assert_allclose(tr.model.get_submodule(n).weight.detach().numpy(), want, rtol=1e-5, atol=1e-6,
                                   err_msg=n)


def test_the_merger_sums_weighted_changes_against_the_base_weight():
    """MergedLoRAs on its own: two files on one weight (a LoRA on some rows at 0.5, a DoRA on all at -1.5), each
    change taken against the base W and summed (float64 reference); a float32 weight on the merge's device is not
    written in place; a bfloat16 one comes back rounded once."""
    from flame_models.pipeline.merged_loras import MergedLoRAs
    g = np.random.default_rng(1)
    lora = A.formats.AdapterPart("lora", {"lora_down.weight": g.standard_normal((3, 10)).astype(np.float32),
                                          "lora_up.weight": g.standard_normal((4, 3)).astype(np.float32)},
                                 alpha=1.5, rows=(2, 6))
    dora = A.formats.AdapterPart("dora", {"lora_down.weight": g.standard_normal((2, 10)).astype(np.float32),
                                          "lora_up.weight": g.standard_normal((8, 2)).astype(np.float32),
                                          "dora_scale": np.abs(g.standard_normal((8, 1))).astype(np.float32) + 1})
    merger = MergedLoRAs([(0.5, {"m": [lora]}), (-1.5, {"m": [dora]})], "cpu")
    w = g.standard_normal((8, 10)).astype(np.float32)
    w64 = w.astype(np.float64)
    want = w64.copy()
    want[2:6] += 0.5 * (lora.merged_weight(w64[2:6]) - w64[2:6])
    want += -1.5 * (dora.merged_weight(w64) - w64)
    t = flame.tensor(w, device="cpu")
    got = merger("m.weight", t)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(t.numpy(), w)                        # the input weight as it was
    assert merger.keys() == {"m.weight"}
    lo = MergedLoRAs([(1.0, {"m": [lora]})], "cpu")
    half = lo("m.weight", flame.tensor(w, device="cpu").to(flame.bfloat16))
    assert half.dtype == flame.bfloat16
    ref = w.astype(np.float64)
    ref[2:6] = lora.merged_weight(ref[2:6])
    np.testing.assert_allclose(half.float().numpy(), ref, rtol=1e-2, atol=2e-2)


def test_a_merge_that_overflows_is_named_once_the_load_returns(tmp_path, flux_file):
    """A change that is not finite in the weight's dtype: the merger notes each weight's finiteness and check()
    names the first bad key (one read for all of them); merge_on_read checks when the load returns, so the run
    stops at setup with the ConfigError."""
    from flame_models.pipeline.merged_loras import MergedLoRAs
    g = np.random.default_rng(2)
    big = A.formats.AdapterPart("lora", {"lora_down.weight": np.full((2, 6), 300.0, np.float32),
                                         "lora_up.weight": np.full((4, 2), 300.0, np.float32)}, alpha=2.0)
    small = A.formats.AdapterPart("lora", {"lora_down.weight": g.standard_normal((2, 6)).astype(np.float32),
                                           "lora_up.weight": g.standard_normal((4, 2)).astype(np.float32)}, alpha=2.0)
    merger = MergedLoRAs([(1.0, {"a": [small], "b": [big]})], "cpu", label="model.lora_path x", error=ConfigError)
    w = flame.tensor(g.standard_normal((4, 6)).astype(np.float32), device="cpu").to(flame.float16)
    merger("a.weight", w)
    got = merger("b.weight", w)                              # 2 x 300 x 300 x 6 > float16's 65504
    assert not np.isfinite(got.float().numpy()).all()
    with pytest.raises(ConfigError, match=r"model.lora_path x: merging it into b.weight gives values that are not "
                                          r"finite \(an overflow of flame.float16"):
        merger.check()
    merger.check()                                           # (the notes were read: nothing left to raise)
    lora = _lora(tmp_path / "huge.safetensors", flux_file, scale=1e20)   # up @ down overflows float32
    tr = Trainer(_config(tmp_path, "huge", flux_file, lora_path=lora), verbose=False)
    with pytest.raises(ConfigError, match=r"model.lora_path .*huge.safetensors: merging it into \S+ gives values "
                                          r"that are not finite"):
        tr.setup()
