"""Textual-inversion embeddings on SDXL (flame_models/conditioning/embeddings.py; SDXLTextEncoders embeddings=,
generate --embedding) against diffusers' load_textual_inversion + encode_prompt on the tiny pipeline
(tests/fixtures/make_embedding_fixtures.py): the prompt embeddings, and the pooled vector at the EOS token (where
diffusers' argmax rule lands on an added token instead, ComfyUI and A1111 pool at EOS); the file checks; the CLI."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_core.io import load_file
from flame_models.conditioning.embeddings import EmbeddingError, load_embedding, parse_spec

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sdxl_pipeline",
                    "embeddings")
TOK = os.path.join(HERE, "tok.safetensors")
REF = {k: v.numpy() for k, v in load_file(os.path.join(HERE, "golden.safetensors")).items()}
with open(os.path.join(HERE, "golden.json")) as f:
    PROMPTS = json.load(f)["prompts"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from sdxl_tiny import sdxl_tiny_folder
    return sdxl_tiny_folder(tmp_path_factory.mktemp("ti") / "sdxl")


@pytest.fixture(scope="module")
def encoders(folder):
    from flame_models.sdxl.conditioning import load_text_encoders
    return load_text_encoders(folder, dtype=flame.float64, device="cpu", embeddings=[TOK])


def test_prompt_embeddings_are_diffusers(encoders):
    got = encoders.encode(PROMPTS)
    for i, p in enumerate(PROMPTS):
        want = REF[f"prompt_embeds_{i}"]
        assert np.abs(got["prompt_embeds"][i].numpy() - want).max() <= 1e-6 * np.abs(want).max(), p
        pooled = REF[f"pooled_eos_{i}"]
        assert np.abs(got["pooled_prompt_embeds"][i].numpy() - pooled).max() <= 1e-6 * np.abs(pooled).max(), p
    # (diffusers' own pooled vector differs exactly where the prompt holds the token: its argmax lands on it)
    assert np.abs(REF["pooled_diffusers_0"] - REF["pooled_eos_0"]).max() > 1e-3
    np.testing.assert_allclose(REF["pooled_diffusers_2"], REF["pooled_eos_2"], rtol=1e-6)


def test_comfyui_syntax_and_weights(folder, encoders):
    from flame_models.sdxl.conditioning import load_text_encoders
    a = encoders.encode(["a photo of tok on the lake"])["prompt_embeds"].numpy()
    b = encoders.encode(["a photo of embedding:tok on the lake"])["prompt_embeds"].numpy()
    np.testing.assert_array_equal(a, b)
    weighted = load_text_encoders(folder, dtype=flame.float64, device="cpu", embeddings=[f"{TOK}:sks"],
                                  prompt_weights=True)
    c = weighted.encode(["a photo of sks on the lake"])["prompt_embeds"].numpy()
    np.testing.assert_array_equal(a, c)                                   # the token given: sks
    d = weighted.encode(["a photo of (sks:1.4) on the lake"])["prompt_embeds"].numpy()
    assert np.abs(d - c).max() > 0


def test_the_file_checks(tmp_path):
    assert parse_spec("x/neg.safetensors") == ("x/neg.safetensors", "neg")
    assert parse_spec("x/neg.safetensors:badXL") == ("x/neg.safetensors", "badXL")
    ti = load_embedding(TOK, {"clip_l": 16, "clip_g": 24})
    assert ti.token == "tok" and ti.vectors["clip_l"].shape == (2, 16)
    cases = {"missing.safetensors": "not a file"}
    for name, tensors, match in (
            ("one.safetensors", {"clip_l": np.ones((2, 16), np.float32)}, "no clip_g tensor"),
            ("wide.safetensors", {"clip_l": np.ones((2, 17), np.float32), "clip_g": np.ones((2, 24), np.float32)},
             r"clip_l has shape \(2, 17\)"),
            ("many.safetensors", {"clip_l": np.ones((80, 16), np.float32), "clip_g": np.ones((80, 24), np.float32)},
             "n <= 75"),
            ("apart.safetensors", {"clip_l": np.ones((2, 16), np.float32), "clip_g": np.ones((3, 24), np.float32)},
             "clip_l has 2 vectors, clip_g 3"),
            ("nan.safetensors", {"clip_l": np.full((2, 16), np.nan, np.float32),
                                 "clip_g": np.ones((2, 24), np.float32)}, "not finite")):
        io.save_file(tensors, str(tmp_path / name))
        cases[name] = match
    (tmp_path / "pickle.pt").write_bytes(b"\x80\x04")
    cases["pickle.pt"] = "only .safetensors"
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    cases["junk.safetensors"] = "cannot read it"
    for name, match in cases.items():
        with pytest.raises(EmbeddingError, match=match):
            load_embedding(str(tmp_path / name), {"clip_l": 16, "clip_g": 24})
    with pytest.raises(EmbeddingError, match="must be one word"):
        parse_spec("x/bad name.safetensors")


def test_generate_with_an_embedding(folder, tmp_path, capsys):
    from PIL import Image

    from flame_models.generate import generate, main
    kw = dict(steps=2, seed=2, width=32, height=32, progress=False, log=lambda *a: None, device="cpu", dtype="fp32")
    out = tmp_path / "out"
    with_ti = np.asarray(generate(folder, "a photo of tok", embeddings=[TOK], output=str(out), **kw)[0], np.int16)
    without = np.asarray(generate(folder, "a photo of tok", **kw)[0], np.int16)   # "tok" read as text
    assert np.abs(with_ti - without).max() > 0
    assert json.loads(Image.open(out / os.listdir(out)[0]).text["flame"])["embeddings"] == [[TOK, "tok"]]
    base = ["--steps", "2", "--output", str(tmp_path / "o"), "--no-progress", "--device", "cpu"]
    assert main(["--model", folder, "--prompt", "a embedding:nope cat"] + base) == 2
    assert "'embedding:nope'" in capsys.readouterr().err
    assert main(["--model", folder, "--prompt", "x", "--embedding", str(tmp_path / "no.safetensors")] + base) == 2
    assert "--embedding: embedding" in capsys.readouterr().err
    cli = tmp_path / "cli"
    assert main(["--model", folder, "--prompt", "a photo of tok", "--embedding", TOK, "--seed", "2", "--width", "32",
                 "--height", "32", "--output", str(cli), "--dtype", "fp32"] + base[:2] + base[4:]) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(cli / os.listdir(cli)[0]), np.int16), with_ti)


def test_the_encoders_config_is_not_shared():
    """add_token_vectors gives the model a config of its own: a config object shared with another load (a
    files object's) keeps its vocabulary size."""
    from flame_models.text_encoders import CLIPTextConfig, CLIPTextModel
    cfg = CLIPTextConfig(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, eos_token_id=2)
    a, b = CLIPTextModel(cfg, device="cpu"), CLIPTextModel(cfg, device="cpu")
    assert a.add_token_vectors(np.ones((3, 8), np.float32)) == [50, 51, 52]
    assert a.config.vocab_size == a.text_model.config.vocab_size == 53
    assert cfg.vocab_size == 50 and b.config.vocab_size == 50
    ids = np.array([[49, 1, 50, 51, 52, 3]])   # (the pooled position: the largest id of the vocabulary, not 52)
    with flame.no_grad():
        out = a(ids)
    np.testing.assert_array_equal(out.pooler_output.numpy(), out.last_hidden_state.numpy()[:, 0])
