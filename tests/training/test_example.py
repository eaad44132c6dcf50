"""examples/train_flux_lora.py as a user meets it: --help, the demo in a fresh folder each time (with --steps that
shortens the warm-up), a file that is not a Flux transformer given as the model (one line, exit 2), and a real run
that resumes by itself and deletes nothing without --fresh."""
import hashlib
import importlib.util
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io

from .conftest import draw_images, make_samples

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_flux_lora.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_flux_lora", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_has_a_line_with_its_default_for_every_flag_and_explains_the_demo_and_resume(example, capsys):
    with pytest.raises(SystemExit) as ei:
        example.main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for action in example.parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings
            assert action.option_strings[-1] in out
    assert "With no arguments the demo runs" in out and "Resume is automatic" in out
    assert "--fresh" in out and "Exit codes: 0 done, 2 bad input" in out
    assert "(default 2000; the demo 400)" in " ".join(out.split())


def _files(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def test_the_demo_runs_with_few_steps_in_a_fresh_folder_each_time(example, tmp_path, capsys):
    quick = ["--steps", "3", "--output", str(tmp_path), "--demo-base-steps", "2"]
    assert example.main(quick + ["--sample-every", "3"]) == 0
    out = capsys.readouterr().out
    assert "note: --steps 3: the 20 warm-up steps are shortened to 0" in out
    assert "the VAE is analytic (weights set by hand: it encodes by 8x8 average pooling" in out
    assert "the transformer pretrained for 2 steps on the 12 shape images" in out
    first = tmp_path / "flux_lora_tiny"
    assert (first / "flux_lora_tiny.safetensors").stat().st_size > 0
    assert "decoded through the VAE; one PNG per prompt and step in samples/" in out
    for step in (0, 3):
        for i in range(3):
            assert (first / "samples" / f"step_{step:06d}_{i}.png").exists()
    assert "python -m flame_models.generate --model " in out and "--max-length 16" in out
    before = _files(first)
    assert example.main(quick + ["--sample-every", "0"]) == 0
    out = capsys.readouterr().out
    assert f"writing to {tmp_path / 'flux_lora_tiny-2'} (a fresh folder)" in out
    assert (tmp_path / "flux_lora_tiny-2" / "flux_lora_tiny-2.safetensors").exists()
    assert _files(first) == before                                  # the earlier demo is untouched


def _fake(path, keys):
    io.save_file({k: np.zeros((2, 2), np.float32) for k in keys}, str(path))
    return str(path)


@pytest.mark.parametrize("kind, keys, words", [
    ("lora", ["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
              "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"], "a LoRA / adapter file"),
    ("peft", ["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"], "a LoRA / adapter file"),
    ("vae", ["encoder.conv_in.weight", "decoder.conv_in.weight", "decoder.up.0.block.0.conv1.weight"],
     "a VAE (autoencoder)"),
    ("clip", ["text_model.embeddings.token_embedding.weight",
              "text_model.encoder.layers.0.self_attn.q_proj.weight"], "a CLIP text encoder"),
    ("t5", ["shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"], "a T5 text encoder"),
    ("sdxl", ["model.diffusion_model.input_blocks.0.0.weight"], "a Stable Diffusion / SDXL UNet"),
    ("other", ["weights.0"], "an unknown model")])
def test_a_file_that_is_not_a_flux_transformer_is_one_line_and_exit_2(example, tmp_path, capsys, kind, keys, words):
    model = _fake(tmp_path / f"{kind}.safetensors", keys)
    data = make_samples(tmp_path / "data", n=2)
    assert example.main(["--model", model, "--data", data, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: command line: model.name_or_path: ")
    assert f"{model} is not a Flux transformer: it looks like {words} (keys such as " in err
    assert not (tmp_path / "flux_lora").exists()                   # nothing was written


def test_a_file_that_is_not_safetensors_at_all(example, tmp_path, capsys):
    model = tmp_path / "flux1-dev.safetensors"
    model.write_text("<html>404 Not Found</html>")
    assert example.main(["--model", str(model), "--data", make_samples(tmp_path / "d", n=2)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable .safetensors file" in err, err


def test_a_real_run_resumes_by_itself_and_deletes_nothing_without_fresh(example, tmp_path, capsys, flux_file):
    data = make_samples(tmp_path / "data", n=4)
    args = ["--model", flux_file, "--data", data, "--output", str(tmp_path), "--name", "real", "--sample-every", "0",
            "--save-every", "2", "--optimizer", "adamw", "--rank", "4"]
    assert example.main(args + ["--steps", "2"]) == 0
    run = tmp_path / "real"
    mine = run / "my_notes.txt"
    mine.write_text("keep me")
    assert example.main(args + ["--steps", "4"]) == 0               # more steps: resumes at 2, applies the change
    out = capsys.readouterr().out
    assert "resumed from" in out and "train.steps 2 -> 4" in out
    assert mine.read_text() == "keep me" and (run / "real_000002.safetensors").exists()
    assert [line.split(",")[0] for line in open(run / "loss.csv").read().split()[1:]] == ["1", "2", "3", "4"]
    assert example.main(args + ["--steps", "4", "--rank", "8"]) == 2   # a rank change cannot continue the run
    assert "network.linear 4 -> 8" in capsys.readouterr().err
    assert example.main(args + ["--steps", "2", "--rank", "8", "--fresh"]) == 0
    out = capsys.readouterr().out
    assert "--fresh: removed" in out and mine.read_text() == "keep me"
    assert not (run / "real_000004.safetensors").exists()


@pytest.mark.parametrize("name", ["flux_dev_24gb.yaml", "flux_dev_12gib.yaml", "flux_dev_10gib.yaml",
                                  "flux_dev_full_finetune_24gb.yaml", "flux_schnell_24gb.yaml"])
def test_the_shipped_configs_parse_and_run_on_a_tiny_model(example, tmp_path, tiny_model, name):
    from flame_models.training.config import read_yaml
    path = os.path.join(os.path.dirname(EXAMPLE), "configs", name)
    data = read_yaml(path)
    proc = data["config"]["process"][0]
    proc.update(device="cpu", training_folder=str(tmp_path))
    full = proc["network"]["type"] == "full"
    if full:   # the budget kept: the cpu streams too, and the full fine-tune trains layer-wise under it
        assert proc["max_gpu_memory"] == "24GiB"
    else:
        proc.pop("max_gpu_memory", None)                              # (the fp8 budgets' plans need a GPU)
    m = proc["model"]
    if "vae_path" in m:                                               # the single-file layout: the tiny model's files
        m.update(name_or_path=os.path.join(tiny_model, "transformer"), vae_path=os.path.join(tiny_model, "vae"),
                 clip_l_path=os.path.join(tiny_model, "text_encoder"),
                 t5_path=os.path.join(tiny_model, "text_encoder_2"), tokenizer_path=tiny_model)
    else:
        m["name_or_path"] = tiny_model
    m.update(dtype="fp32", t5_max_length=8)
    if "assistant_lora_path" in m:                                    # a training adapter for the tiny transformer
        m["assistant_lora_path"] = _tiny_adapter(tiny_model, tmp_path / "adapter.safetensors")
    proc["datasets"][0].update(folder_path=draw_images(tmp_path / "images", 2, 2), resolution=64,
                               bucket_tolerance=32)
    proc["train"].update(steps=2, dtype="fp32")
    if full:
        proc["train"]["full_bf16"] = False                            # (bf16 weights need model.dtype bf16)
    proc["sample"].update(sample_steps=2, sample_every=2)
    small = tmp_path / name
    import yaml
    small.write_text(yaml.safe_dump(data))
    assert example.main(["--config", str(small)]) == 0
    run_name = data["config"]["name"]
    run = tmp_path / run_name
    meta = io.load_metadata(str(run / f"{run_name}.safetensors"))
    assert meta["name"] == run_name                                   # [name] -> the name
    if full:
        assert meta["flame.network"] == "full"
    last = len(proc["sample"]["prompts"]) - 1
    assert (run / "samples" / f"step_000002_{last}.png").exists()    # every prompt, decoded
    assert (tmp_path / "images" / ".flame_cache" / "latents").is_dir()


def _tiny_adapter(tiny_model, path):
    """A diffusers-named LoRA (the training adapter's layout) with random values on the tiny transformer."""
    import flame_nn.adapters as A
    from flame_models.flux import load_flux
    m = load_flux(os.path.join(tiny_model, "transformer"), device="cpu")
    A.inject_adapters(m, [n for n, _ in m.named_modules() if n.endswith(("attn.qkv", "attn.proj", "linear1"))],
                      rank=4, alpha=4)
    g = np.random.default_rng(0)
    for p in A.adapter_parameters(m):
        p.data = flame.tensor(g.standard_normal(tuple(p.shape)).astype(np.float32) * 0.02, device="cpu")
    A.save_adapters(m, str(path), "peft")
    return str(path)


def test_the_example_under_the_launcher_on_two_ranks_writes_and_reports_once(tmp_path, tiny_model):
    """`python -m flame_core.distributed.run --nproc-per-node 2 examples/train_flux_lora.py ...` on the cpu ("store"
    backend): rank 0 writes the LoRA, samples and loss log; the summary is printed once (by rank 0)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    images = draw_images(tmp_path / "images", 2, 2)
    cmd = [sys.executable, "-m", "flame_core.distributed.run", "--nproc-per-node", "2", EXAMPLE, "--model",
           tiny_model, "--data", images, "--trigger", "ohwx", "--resolution", "64", "--steps", "4",
           "--sample-every", "4", "--output", str(tmp_path / "runs"), "--name", "two", "--device", "cpu"]
    r = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": root, "OPENBLAS_NUM_THREADS": "1"},
                       capture_output=True, timeout=300)
    out = r.stdout.decode()
    assert r.returncode == 0, (out[-2000:], r.stderr.decode()[-3000:])
    assert out.count("wrote:") == 1 and "[rank0]:   LoRA" in out, out[-2000:]
    run = tmp_path / "runs" / "two"
    assert (run / "two.safetensors").exists() and (run / "samples.png").exists()
    assert [line.split(",")[0] for line in open(run / "loss.csv").read().split()[1:]] == ["1", "2", "3", "4"]
