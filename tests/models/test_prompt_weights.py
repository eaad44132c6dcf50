"""Prompt weights in ComfyUI's syntax (flame_models/conditioning/prompt_weights.py; the bundles' prompt_weights=True,
generate --prompt-weights) against tests/fixtures/make_prompt_weight_fixtures.py -- ComfyUI's own parser functions and
its tokenize / encode_token_weights rules run with transformers' models: SDXL's CLIPs on the tiny SDXL pipeline (the
ids, the weights, the weighted states, the pooled vector), SD3's CLIPs and T5 and Flux's T5 on the tiny SD3
pipeline's encoders; the parser on its own cases; long captions in kohya's chunks; the command line."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import load_file
from flame_models.conditioning import prompt_weights as PW
from flame_models.tokenization import load_tokenizer

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sdxl_pipeline")
REF = {k: v.numpy() for k, v in load_file(os.path.join(HERE, "prompt_weights.safetensors")).items()}
with open(os.path.join(HERE, "prompt_weights.json")) as f:
    PROMPTS = json.load(f)["prompts"]


def test_parse():
    assert PW.parse("a (red:1.3) cat") == [("a ", 1.0), ("red", 1.3), (" cat", 1.0)]
    assert PW.parse("((big)) dog") == [("big", 1.1 * 1.1), (" dog", 1.0)]
    assert PW.parse("(a (b:1.5) c:0.5)") == [("a ", 0.5), ("b", 1.5), (" c", 0.5)]
    assert PW.parse("a \\(literal\\) (x)") == [("a (literal) ", 1.0), ("x", 1.1)]
    assert PW.parse("time 10:30 (clock:face)") == [("time 10:30 ", 1.0), ("clock:face", 1.1)]   # (not a number)
    assert PW.parse("a ) b (c") == [("a ) b (c", 1.0)]                  # unbalanced: text, as ComfyUI reads it
    assert PW.parse("") == [] and PW.parse("plain") == [("plain", 1.0)]
    assert PW.is_weighted("(x:1.2)") and PW.is_weighted("(x)") and not PW.is_weighted("(x:1)")
    assert not PW.is_weighted("no weights here")
    for bad in ("(x:nan)", "(x:inf)", "(x:-inf)"):
        with pytest.raises(ValueError, match="not a finite number"):
            PW.parse(bad)
    assert PW.WEIGHT_PATTERN.search("a (cat:1.2)") and not PW.WEIGHT_PATTERN.search("a photo (1990)")


@pytest.mark.parametrize("kind, sub", [("clip_l", "tokenizer"), ("clip_g", "tokenizer_2")])
def test_ids_and_weights_are_comfyuis(kind, sub):
    tok = load_tokenizer(kind, os.path.join(HERE, sub))
    ids, weights = PW.weighted_ids(tok, PROMPTS)
    assert ids.shape == weights.shape == (len(PROMPTS), 77)
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(ids[i], REF[f"ids_{kind[-1]}_{i}"], err_msg=PROMPTS[i])
        np.testing.assert_array_equal(weights[i], REF[f"weights_{i}"], err_msg=PROMPTS[i])
    plain = "a photo of a cat"                         # without weights: the plain tokenizer's ids
    np.testing.assert_array_equal(PW.weighted_ids(tok, [plain])[0], tok([plain]).input_ids)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from sdxl_tiny import sdxl_tiny_folder

    from flame_models.sdxl.conditioning import load_text_encoders
    folder = sdxl_tiny_folder(tmp_path_factory.mktemp("pw") / "sdxl")
    out = {}
    for weighted in (False, True):
        out[weighted] = load_text_encoders(folder, dtype=flame.float64, device="cpu", prompt_weights=weighted)
        out[(weighted, 150)] = load_text_encoders(folder, dtype=flame.float64, device="cpu", max_token_length=150,
                                                  prompt_weights=weighted)
    return out


def test_weighted_states_are_comfyuis(encoders):
    got = encoders[True].encode(PROMPTS)
    for i, p in enumerate(PROMPTS):
        want, pooled = REF[f"prompt_embeds_{i}"], REF[f"pooled_{i}"]
        scale = np.abs(want).max()
        assert np.abs(got["prompt_embeds"][i].numpy() - want).max() <= 1e-6 * scale, p
        assert np.abs(got["pooled_prompt_embeds"][i].numpy() - pooled).max() <= 1e-6 * np.abs(pooled).max(), p
    # off (diffusers' reading): the parentheses are text, so a weighted prompt's states differ from ComfyUI's
    plain = encoders[False].encode(PROMPTS[:1])["prompt_embeds"][0].numpy()
    assert np.abs(plain - REF["prompt_embeds_0"]).max() > 1e-3
    # a prompt without weights is the plain encoding either way
    np.testing.assert_array_equal(encoders[True].encode(["a photo of a cat"])["prompt_embeds"].numpy(),
                                  encoders[False].encode(["a photo of a cat"])["prompt_embeds"].numpy())


def test_long_captions_in_chunks_carry_their_weights(encoders):
    """max_token_length 150 (kohya's chunks): a short prompt's first 76 states are the unchunked ones (the first
    chunk holds all of it), and a word past the first 75 tokens gets its weight in the second chunk."""
    short = encoders[(True, 150)].encode(PROMPTS[:2])["prompt_embeds"].numpy()
    whole = encoders[True].encode(PROMPTS[:2])["prompt_embeds"].numpy()
    assert short.shape[1] == 152
    np.testing.assert_allclose(short[:, :76], whole[:, :76], rtol=0, atol=1e-12)
    long = "a photo of a cat " * 20 + "(lake:1.4)"               # 80 words, the weighted one in the second chunk
    tok = encoders[(True, 150)].clip_l_tokenizer
    ids, w = PW.weighted_ids(tok, [long], 150)
    joined = PW.join_chunks(w, 1)
    assert ids.shape == (2, 77) and joined.shape == (1, 152)
    lake = tok.backend.encode_batch(["lake"])[0]
    before = sum(len(tok.backend.encode_batch([w])[0]) for w in ("a photo of a cat " * 20).split())
    assert 75 < before < 150 - len(lake)                        # (the weighted word lies in the second chunk)
    at = [k for k in range(1, 151) if joined[0, k] == np.float32(1.4)]
    assert at == list(range(1 + before, 1 + before + len(lake)))   # after BOS and the repeated phrase's tokens
    with_w = encoders[(True, 150)].encode([long])["prompt_embeds"].numpy()
    without = encoders[(True, 150)].encode([long.replace("(lake:1.4)", "lake")])["prompt_embeds"].numpy()
    moved = np.abs(with_w - without).max(axis=-1)[0]
    assert moved[at[0]] > 0 and np.all(moved[:at[0]] == 0)


def test_generate_prompt_weights(tmp_path, capsys):
    from PIL import Image
    from sdxl_tiny import sdxl_tiny_folder

    from flame_models.bfl.tiny import tiny_flux_files
    from flame_models.generate import generate, main
    folder = sdxl_tiny_folder(tmp_path / "sdxl")
    logs = []
    kw = dict(steps=2, seed=2, width=32, height=32, progress=False, device="cpu", dtype="fp32")
    plain = np.asarray(generate(folder, "a (photo:1.6) of a cat", log=logs.append, **kw)[0], np.int16)
    assert any("--prompt-weights applies them" in str(m) for m in logs)
    out = tmp_path / "out"
    weighted = np.asarray(generate(folder, "a (photo:1.6) of a cat", prompt_weights=True, output=str(out),
                                   log=lambda *a: None, **kw)[0], np.int16)
    assert np.abs(weighted - plain).max() > 0
    assert json.loads(Image.open(out / os.listdir(out)[0]).text["flame"])["prompt_weights"] is True
    base = ["--steps", "2", "--output", str(tmp_path / "o"), "--no-progress", "--device", "cpu"]
    assert main(["--model", folder, "--prompt", "a (cat:nan)", "--prompt-weights"] + base) == 2
    assert "--prompt-weights: prompt weight nan" in capsys.readouterr().err
    from flame_models.chroma.tiny import tiny_chroma_files
    chroma = tiny_chroma_files(tmp_path / "chroma", seed=1)
    assert main(["--model", os.path.dirname(chroma.transformer), "--prompt", "x", "--prompt-weights"] + base) == 2
    assert "--prompt-weights: a Flux / SD3 / SDXL / Flux Kontext option; this model is Chroma" in \
        capsys.readouterr().err
    flux = tiny_flux_files(tmp_path / "flux", seed=1)          # Flux reads them (T5's states)
    flux_kw = dict(steps=2, seed=2, width=32, height=32, progress=False, log=lambda *a: None, device="cpu",
                   dtype="fp32")
    a = np.asarray(generate(flux, "a (red:1.8) square", prompt_weights=True, **flux_kw)[0], np.int16)
    b = np.asarray(generate(flux, "a (red:1.8) square", **flux_kw)[0], np.int16)
    assert np.abs(a - b).max() > 0


SD3_DIR = os.path.join(os.path.dirname(HERE), "sd3_pipeline")
SD3_REF = {k: v.numpy() for k, v in load_file(os.path.join(SD3_DIR, "prompt_weights.safetensors")).items()}
T5_LENGTH = 32


def _close(got, want, what):
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-6 * np.abs(want).max(), what


def test_sd3_weights_on_both_clips_and_t5():
    """SD3: CLIP-L / CLIP-G (their penultimate states, zero-padded to T5's width) and T5 weighted, each against its
    own empty prompt; the pooled vectors the plain prompt's."""
    from flame_models.sd3.pipeline import find_sd3_files, load_text_encoders
    files = find_sd3_files(os.path.join(SD3_DIR, "pipeline"))
    with load_text_encoders(files, dtype=flame.float64, device="cpu", max_length=T5_LENGTH,
                            prompt_weights=True) as enc:
        ids, w = PW.weighted_ids(enc.t5_tokenizer, PROMPTS, length=T5_LENGTH)
        out = enc.encode(PROMPTS)
    pe, pooled = out["prompt_embeds"].numpy(), out["pooled_prompt_embeds"].numpy()
    for i, p in enumerate(PROMPTS):
        np.testing.assert_array_equal(ids[i], SD3_REF[f"t5_ids_{i}"], err_msg=p)
        np.testing.assert_array_equal(w[i], SD3_REF[f"t5_weights_{i}"], err_msg=p)
        cl, cg = SD3_REF[f"clip_l_{i}"], SD3_REF[f"clip_g_{i}"]
        _close(pe[i, :77, :cl.shape[1]], cl, f"clip_l {p}")
        _close(pe[i, :77, cl.shape[1]:cl.shape[1] + cg.shape[1]], cg, f"clip_g {p}")
        assert not pe[i, :77, cl.shape[1] + cg.shape[1]:].any()
        _close(pe[i, 77:], SD3_REF[f"t5_{i}"], f"t5 {p}")
        _close(pooled[i], np.concatenate([SD3_REF[f"pooled_l_{i}"], SD3_REF[f"pooled_g_{i}"]]), f"pooled {p}")


def test_flux_weights_on_t5():
    """Flux's bundle (bfl/conditioning.py) on the same CLIP-L and T5: T5's states weighted as SD3's are, the pooled
    vector CLIP-L's pooler_output of the plain prompt."""
    from flame_models.bfl.conditioning import FluxTextEncoders
    from flame_models.text_encoders import load_clip, load_t5
    root = os.path.join(SD3_DIR, "pipeline")
    clip = load_clip(os.path.join(root, "text_encoder"), dtype=flame.float64, device="cpu", projection=False)
    t5 = load_t5(os.path.join(root, "text_encoder_3"), dtype=flame.float64, device="cpu")
    ctok = load_tokenizer("clip_l", os.path.join(root, "tokenizer"))
    ttok = load_tokenizer("t5", os.path.join(root, "tokenizer_3"), max_length=T5_LENGTH)
    with FluxTextEncoders(clip, t5, ctok, ttok, max_length=T5_LENGTH, prompt_weights=True) as enc:
        out = enc.encode(PROMPTS)
        plain_ids, _ = PW.weighted_ids(ctok, PROMPTS)
        with flame.no_grad():
            want_pooled = enc.clip(plain_ids).pooler_output.numpy()
    for i, p in enumerate(PROMPTS):
        _close(out["prompt_embeds"][i].numpy(), SD3_REF[f"t5_{i}"], f"t5 {p}")
    np.testing.assert_allclose(out["pooled_prompt_embeds"].numpy(), want_pooled, rtol=1e-12, atol=1e-12)
