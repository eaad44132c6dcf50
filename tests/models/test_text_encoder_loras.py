"""The text-encoder parts of LoRA files at sampling time for Flux (CLIP-L: kohya lora_te1_ / diffusers text_encoder.;
T5: kohya lora_te3_ / diffusers text_encoder_2.) and SD3 (CLIP-L, CLIP-G, T5: lora_te1_ / lora_te2_ / lora_te3_ or
text_encoder. / text_encoder_2. / text_encoder_3.): merged into the encoders they name, equal to the adapters
unmerged, nothing at weight 0, a part that fits no layer named, a streamed T5 refused before anything loads, and
through generate() end to end. (SDXL's CLIP-L / CLIP-G: tests/models/test_sdxl_pipeline.py.)"""
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import safe_open, save_file
from flame_models.flux import pipeline as FP
from flame_models.flux.tiny import tiny_flux_files
from flame_models.sd3 import pipeline as SP
from flame_nn import adapters as A

F32 = flame.float32
SD3_PIPELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "sd3_pipeline", "pipeline")
PROMPT = ["a red cube on a table"]
CLIP_TARGETS = ["q_proj", "fc1"]
T5_TARGETS = ["SelfAttention.q", "DenseReluDense.wo"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tiny_flux_files(tmp_path_factory.mktemp("tiny") / "flux", seed=2)


def encodings(enc):
    return {k: v.float().numpy() for k, v in enc.encode(PROMPT).items()}


def te_lora_file(path, parts, fmt, rng):
    """Random adapters on each (encoder, targets, kohya prefix, diffusers prefix) of `parts` (adapters left on the
    encoders, unmerged, for the expected encodings), written into one file at `path` in `fmt` under the prefixes."""
    sd = {}
    for k, (encoder, targets, kohya, diffusers) in enumerate(parts):
        A.inject_adapters(encoder, targets, rank=2, alpha=1.0)
        with flame.no_grad():
            for _, p in A.named_adapter_parameters(encoder):
                p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32)))
        one = A.save_adapters(encoder, f"{path}.{k}", format=fmt)
        with safe_open(one) as f:
            for key in f.keys():   # the encoder's own module names, under the part's prefix
                if fmt == "kohya":
                    sd[kohya + key[len("lora_unet_"):]] = f.get_array(key)
                else:
                    sd[diffusers + key.split(".", 1)[1]] = f.get_array(key)
    save_file(sd, path)
    return path


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_flux_clip_l_and_t5_parts_are_merged(flux, tmp_path, fmt):
    with FP.load_text_encoders(flux, dtype=F32, device="cpu") as enc:
        base = encodings(enc)
        path = te_lora_file(str(tmp_path / f"te_{fmt}.safetensors"),
                            [(enc.clip, CLIP_TARGETS, "lora_te1_", "text_encoder."),
                             (enc.t5, T5_TARGETS, "lora_te3_", "text_encoder_2.")], fmt, np.random.default_rng(1))
        want = encodings(enc)
    assert all(np.abs(want[k] - base[k]).max() > 1e-3 for k in want)   # both parts change the conditioning
    loras = FP.check_loras([path], flux.params)                         # accepted by the transformer's check
    with FP.load_text_encoders(flux, dtype=F32, device="cpu", loras=loras) as enc:
        got = encodings(enc)
        assert not A.adapter_names(enc.clip) and not A.adapter_names(enc.t5)   # merged into the weights
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    with FP.load_text_encoders(flux, dtype=F32, device="cpu", loras=[(path, 0.0)]) as enc:
        for k, v in encodings(enc).items():
            np.testing.assert_allclose(v, base[k], rtol=1e-6, atol=1e-6)
    # the transformer takes the file too: it has no transformer part, which changes nothing there
    FP.load_transformer(flux, dtype=F32, device="cpu", loras=loras)
    # T5 in fp8 storage keeps its part as adapters beside the fp8 weights: the LoRA's change within fp8's error
    with FP.load_text_encoders(flux, dtype=F32, device="cpu", t5_quantize="fp8") as enc:
        q = encodings(enc)["prompt_embeds"]
    with FP.load_text_encoders(flux, dtype=F32, device="cpu", t5_quantize="fp8", loras=loras) as enc:
        assert A.adapter_names(enc.t5) and not A.adapter_names(enc.clip)
        got = encodings(enc)["prompt_embeds"]
    fp8_error = np.abs(q - base["prompt_embeds"]).max()
    assert np.abs(got - want["prompt_embeds"]).max() < 2 * fp8_error < np.abs(got - q).max()


def test_flux_t5_part_that_fits_no_layer_or_a_streamed_t5_is_named(flux, tmp_path):
    with FP.load_text_encoders(flux, dtype=F32, device="cpu") as enc:
        path = te_lora_file(str(tmp_path / "te.safetensors"), [(enc.t5, T5_TARGETS, "lora_te3_", "text_encoder_2.")],
                            "kohya", np.random.default_rng(2))
    with safe_open(path) as f:
        sd = {k: f.get_array(k) for k in f.keys()}
    key = next(k for k in sd if k.endswith("lora_down.weight"))
    sd[key] = np.concatenate([sd[key], sd[key]], axis=1)
    bad = str(tmp_path / "bad.safetensors")
    save_file(sd, bad)
    with pytest.raises(FP.FluxFilesError, match="bad.safetensors"):
        FP.load_text_encoders(flux, dtype=F32, device="cpu", loras=[(bad, 1.0)])
    with pytest.raises(FP.FluxFilesError, match=r"te\.safetensors: holds T5 weights \(te3 keys\).*streams from host"):
        FP.load_text_encoders(flux, dtype=F32, device="cpu", t5_stream=True, loras=[(path, 1.0)])


def test_flux_generate_applies_a_text_encoder_lora(flux, tmp_path):
    from flame_models.generate import generate
    with FP.load_text_encoders(flux, dtype=F32, device="cpu") as enc:
        path = te_lora_file(str(tmp_path / "clip.safetensors"), [(enc.clip, CLIP_TARGETS, "lora_te1_", "")],
                            "kohya", np.random.default_rng(3))
    kw = dict(width=32, height=32, steps=2, seed=5, progress=False, log=lambda *a: None, device="cpu")
    base = np.asarray(generate(flux, "a red cube", **kw)[0]).astype(np.int16)
    zero = np.asarray(generate(flux, "a red cube", loras=[f"{path}:0"], **kw)[0]).astype(np.int16)
    full = np.asarray(generate(flux, "a red cube", loras=[path], **kw)[0]).astype(np.int16)
    assert np.array_equal(zero, base) and np.abs(full - base).max() > 0


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_sd3_clip_l_clip_g_and_t5_parts_are_merged(tmp_path, fmt):
    files = SP.find_sd3_files(SD3_PIPELINE)
    with SP.load_text_encoders(files, dtype=F32, device="cpu") as enc:
        base = encodings(enc)
        path = te_lora_file(str(tmp_path / f"sd3_{fmt}.safetensors"),
                            [(enc.clip_l, CLIP_TARGETS, "lora_te1_", "text_encoder."),
                             (enc.clip_g, CLIP_TARGETS, "lora_te2_", "text_encoder_2."),
                             (enc.t5, T5_TARGETS, "lora_te3_", "text_encoder_3.")], fmt, np.random.default_rng(4))
        want = encodings(enc)
    assert all(np.abs(want[k] - base[k]).max() > 1e-3 for k in want)
    loras = SP.check_loras([path], files.params)
    with SP.load_text_encoders(files, dtype=F32, device="cpu", loras=loras) as enc:
        got = encodings(enc)
        assert not any(A.adapter_names(m) for m in (enc.clip_l, enc.clip_g, enc.t5))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    with SP.load_text_encoders(files, dtype=F32, device="cpu", t5=False, loras=loras) as enc:
        assert enc.t5 is None   # without T5 its part has nothing to change; CLIP's parts still apply
    with pytest.raises(SP.SD3FilesError, match="holds T5 weights"):
        SP.load_text_encoders(files, dtype=F32, device="cpu", t5_stream=True, loras=loras)


def test_a_te3_part_is_a_text_encoder_part_not_the_denoisers():
    assert A.formats.component_of("lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight") == "te3"
    assert A.formats.component_of("text_encoder_3.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight") == "te3"
    assert A.formats.component_of("text_encoder_2.x.lora_A.weight") == "te2"
    assert A.formats.component_of("transformer.x.lora_A.weight") == "denoiser"
