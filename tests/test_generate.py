"""python -m flame_models.generate and generate(): PNGs with their parameters, seeds, LoRA files of every layout and
weight, fp8 and memory-budget runs, and bad input refused before any work (exit 2, the file named)."""
import gc
import json
import os

import numpy as np
import pytest
from PIL import Image

import flame_core as flame
from flame_core import memory
from flame_core.io import safe_open, save_file
from flame_models.flux import load_flux
from flame_models.flux.tiny import tiny_flux_files
from flame_models.generate import GenerateError, generate, main
from flame_nn import adapters as A

SIZE = dict(width=48, height=32, steps=3)
DEVICE = "cuda" if flame.cuda_is_available() else "cpu"   # where generate() runs by default


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_flux_files(tmp_path_factory.mktemp("tiny") / "flux", seed=1)


@pytest.fixture(scope="module")
def loras(tiny, tmp_path_factory):
    """One random LoRA (rank 4, alpha 2: scale 0.5) on every block Linear of the tiny model, written in FLAME's kohya
    and PEFT files, as ai-toolkit writes it (diffusers names, the scale folded into lora_B, no metadata), and with a
    wrong input width."""
    d = tmp_path_factory.mktemp("loras")
    model = load_flux(tiny.transformer, dtype=flame.float32, device="cpu")
    A.inject_adapters(model, ["double_blocks.*", "single_blocks.*"], rank=4, alpha=2.0)
    rng = np.random.default_rng(0)
    with flame.no_grad():
        for _, p in A.named_adapter_parameters(model):
            p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32)))
    kohya = A.save_adapters(model, str(d / "kohya.safetensors"), format="kohya")
    peft = A.save_adapters(model, str(d / "peft.safetensors"), format="peft")
    with safe_open(peft) as f:
        sd = {k: f.get_array(k) for k in f.keys()}
    save_file(sd, str(d / "aitoolkit.safetensors"))           # no flame.alphas: scale 1 on the folded lora_B
    with safe_open(kohya) as f:
        bad = {k: f.get_array(k) for k in f.keys()}
    key = "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    bad[key] = np.zeros((4, 128), np.float32)
    save_file(bad, str(d / "other_size.safetensors"))
    return {"kohya": kohya, "peft": peft, "aitoolkit": str(d / "aitoolkit.safetensors"),
            "other_size": str(d / "other_size.safetensors")}


def pixels(images):
    return np.stack([np.asarray(im).astype(np.int16) for im in images])


def run(tiny, prompts="a red square", **kw):
    return pixels(generate(tiny, prompts, **dict(SIZE, seed=kw.pop("seed", 7), progress=False, log=lambda *a: None,
                                                 **kw)))


# ----------------------------------------------------------------------------- the command end to end
def test_command_writes_pngs_with_their_parameters(tiny, loras, tmp_path, capsys):
    root = os.path.dirname(tiny.transformer)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a blue circle\n\n  a yellow triangle  \n", encoding="utf-8")
    out = tmp_path / "out"
    rc = main(["--model", root, "--prompt", "a red square", "--prompts-file", str(prompts), "--num-images", "2",
               "--lora", f"{loras['kohya']}:0.75", "--width", "48", "--height", "32", "--steps", "3", "--seed",
               "11", "--guidance", "2.5", "--output", str(out), "--batch-size", "4", "--dtype", "fp32",
               "--no-progress"])
    assert rc == 0
    names = sorted(os.listdir(out))
    assert names == [f"{i:05d}-{s}.png" for i, s in enumerate([11, 12] * 3)]
    im = Image.open(out / names[3])
    assert im.size == (48, 32) and im.mode == "RGB"
    params = im.text["parameters"]
    assert params.startswith("a blue circle\nSteps: 3, Sampler: Euler")
    for field in ("Distilled CFG Scale: 2.5", "Seed: 12", "Size: 48x32", "Model: flux",
                  "Loras: kohya.safetensors:0.75"):
        assert field in params
    info = json.loads(im.text["flame"])
    assert info["prompt"] == "a blue circle" and info["seed"] == 12 and info["steps"] == 3
    assert info["model"] == tiny.transformer and info["loras"] == [[loras["kohya"], 0.75]]
    assert info["dtype"] == "float32"
    assert "peak" in capsys.readouterr().err
    # the seed in the file regenerates the image, alone in its batch this time, to one level of 255: the BLAS picks
    # GEMM kernels by shape (cuBLAS; OpenBLAS's SkylakeX kernels for small matrices), so float32 sums of another
    # batch size may differ in the last bits and round a pixel the other way. Another seed or prompt is far off.
    again = run(tiny, "a blue circle", seed=12, guidance=2.5, loras=[f"{loras['kohya']}:0.75"], dtype="float32")
    png = np.asarray(im).astype(np.int16)
    assert np.abs(again[0] - png).max() <= 1
    for change in ({"seed": 11}, {"prompts": "a red square"}, {"guidance": 3.5}, {"loras": []}):
        kw = {"prompts": "a blue circle", "seed": 12, "guidance": 2.5, "loras": [f"{loras['kohya']}:0.75"], **change}
        other = run(tiny, kw.pop("prompts"), dtype="float32", **kw)
        assert np.abs(other[0] - png).max() > 8, change
    assert main(["--model", root, "--prompt", "x", "--width", "48", "--height", "32", "--steps", "1", "--seed",
                 "3", "--output", str(out), "--no-progress"]) == 0
    assert sorted(os.listdir(out))[-1] == "00006-3.png"
    assert not [n for n in os.listdir(out) if not n.endswith(".png")]     # no temporary file left


def _one_png(tiny, tmp_path, *flags):
    """The command on the tiny Flux with `flags` (48 x 32, 4 steps, seed 5, float32): its PNG."""
    out = tmp_path / "out"
    assert main(["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--width", "48", "--height", "32",
                 "--steps", "4", "--seed", "5", *flags, "--output", str(out), "--dtype", "fp32", "--no-progress"]) == 0
    return Image.open(out / "00000-5.png")


def test_the_dpmpp_2m_sampler_from_the_command(tiny, tmp_path):
    """--sampler dpmpp_2m on a Flux: its name in the PNG's parameters ("DPM++ 2M", as A1111), another image than
    Euler's from 4 steps (its first two steps from sigma 1 are Euler's), Euler's at 1 step."""
    im = _one_png(tiny, tmp_path, "--sampler", "dpmpp_2m")
    assert "Steps: 4, Sampler: DPM++ 2M" in im.text["parameters"]
    kw = dict(SIZE, steps=4, seed=5, dtype="float32")
    dpm, euler = run(tiny, "x", sampler="dpmpp_2m", **kw), run(tiny, "x", **kw)
    np.testing.assert_array_equal(dpm[0], np.asarray(im).astype(np.int16))
    assert np.abs(dpm - euler).max() > 0
    np.testing.assert_array_equal(run(tiny, "x", sampler="dpmpp_2m", **{**kw, "steps": 1}),
                                  run(tiny, "x", **{**kw, "steps": 1}))


def test_the_scheduler_option_from_the_command(tiny, tmp_path, capsys):
    """--scheduler beta on a Flux: "Schedule type: Beta" and "scheduler" in the PNG, another image than the default
    ("simple": Flux's own sigmas); an unknown one exits 2 before loading; --karras names --scheduler karras."""
    im = _one_png(tiny, tmp_path, "--scheduler", "beta")
    assert "Steps: 4, Sampler: Euler, Schedule type: Beta" in im.text["parameters"]
    assert json.loads(im.text["flame"])["scheduler"] == "beta"
    kw = dict(SIZE, steps=4, seed=5, dtype="float32")
    beta, simple = run(tiny, "x", scheduler="beta", **kw), run(tiny, "x", **kw)
    np.testing.assert_array_equal(beta[0], np.asarray(im).astype(np.int16))
    assert np.abs(beta - simple).max() > 0
    np.testing.assert_array_equal(run(tiny, "x", scheduler="simple", **kw), simple)
    with pytest.raises(GenerateError, match="--scheduler normal: Flux samples with simple, karras, exponential or "
                                            "beta"):
        generate(tiny, "x", scheduler="normal")
    assert main(["--model", os.path.dirname(tiny.transformer), "--prompt", "x", "--karras", "--output",
                 str(tmp_path / "out"), "--no-progress"]) == 2
    assert "--karras: an SDXL option; this model is Flux: use --scheduler karras" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_images_depend_on_seed_and_prompt_not_on_batching(tiny, dtype):
    one = run(tiny, ["a red square", "a blue circle"], num_images=2, batch_size=1, dtype=dtype)
    batched = run(tiny, ["a red square", "a blue circle"], num_images=2, batch_size=3, dtype=dtype)
    assert np.abs(one[0] - one[1]).mean() > 2      # seeds 7 and 8
    other_prompt = np.abs(one[0] - one[2]).mean()   # same seed
    assert other_prompt > 0.5
    diff = np.abs(one - batched)
    if DEVICE == "cpu" or dtype == "float32":
        # each image's arithmetic does not depend on its batch (bf16 included: the adaLN LayerNorm runs per
        # sample); on cuda float32 GEMMs of other shapes differ in the last bits
        assert diff.max() <= 1
    else:
        # cuBLAS picks bf16 GEMM kernels by shape (M = batch x tokens, and M = batch for the conditioning MLPs), so
        # some outputs round the other way (2^-8 relative), which this tiny random model carries to a few pixel
        # levels: batching must still change an image far less than another prompt does
        assert diff.mean() < 0.5 * other_prompt


# ----------------------------------------------------------------------------- LoRAs
def test_lora_weight_zero_is_the_base_and_one_is_the_loras(tiny, loras):
    base = run(tiny)
    np.testing.assert_array_equal(run(tiny, loras=[f"{loras['kohya']}:0"]), base)
    full = run(tiny, loras=[loras["kohya"]])
    assert np.abs(full - base).mean() > 2
    # the same ΔW from the other layouts: FLAME's PEFT file, ai-toolkit's (scale folded in, no metadata)
    assert np.abs(run(tiny, loras=[loras["peft"]]) - full).max() <= 1
    assert np.abs(run(tiny, loras=[f"{loras['aitoolkit']}:1.0"]) - full).max() <= 1
    # weights add up: two halves are the whole
    halves = run(tiny, loras=[f"{loras['kohya']}:0.5", (loras["peft"], 0.5)])
    assert np.abs(halves - full).max() <= 1
    assert np.abs(run(tiny, loras=[f"{loras['kohya']}:0.5"]) - full).mean() > 0.5


def test_lora_merged_equals_the_weights_changed_by_hand(tiny, loras):
    """Merging adds weight·(alpha/r)·up·down to each adapted Linear, read straight from the kohya file."""
    from flame_models.flux.pipeline import load_transformer
    model = load_transformer(tiny, dtype=flame.float32, device="cpu", loras=[f"{loras['kohya']}:0.8"])
    assert A.adapter_names(model) == []     # folded in and dropped: plain Linears, no copy of the old weights
    base = load_flux(tiny.transformer, dtype=flame.float32, device="cpu")
    with safe_open(loras["kohya"]) as f:
        sd = {k: f.get_array(k) for k in f.keys()}
    for name in ("double_blocks.1.img_attn.qkv", "single_blocks.0.linear1", "double_blocks.0.txt_mlp.2"):
        k = "lora_unet_" + name.replace(".", "_")
        up, down = sd[k + ".lora_up.weight"].astype(np.float64), sd[k + ".lora_down.weight"].astype(np.float64)
        want = base.get_submodule(name).weight.detach().numpy() + 0.8 * float(sd[k + ".alpha"]) / 4 * up @ down
        np.testing.assert_allclose(model.get_submodule(name).weight.numpy(), want, rtol=1e-5, atol=1e-6)


def test_loras_are_summed_then_rounded_once(tiny, loras):
    """Two LoRAs at 0.5 merge into a bf16 model as one at 1 does, bit for bit: the changes are summed in float32
    and each weight is rounded once (merged one after the other, it would be rounded twice)."""
    from flame_models.flux.pipeline import load_transformer
    kw = dict(dtype=flame.bfloat16, device=DEVICE)
    one = load_transformer(tiny, loras=[loras["kohya"]], **kw)
    halves = load_transformer(tiny, loras=[f"{loras['kohya']}:0.5", (loras["kohya"], 0.5)], **kw)
    base = load_flux(tiny.transformer, **kw).requires_grad_(False)
    changed = 0
    for (name, a), (_, b), (_, w) in zip(one.named_parameters(), halves.named_parameters(), base.named_parameters()):
        np.testing.assert_array_equal(b.float().numpy(), a.float().numpy(), err_msg=name)
        changed += int((a.float().numpy() != w.float().numpy()).any())
    assert changed >= 20    # every block Linear carries the LoRA


# ----------------------------------------------------------------------------- fp8 and the memory budget
@pytest.mark.gpu_exclusive  # the budget counts the device's memory outside the pool
def test_fp8_and_budget(tiny, loras):
    plain = run(tiny, loras=[loras["kohya"]])
    fp8 = run(tiny, fp8=True, loras=[loras["kohya"]])
    assert 0 < np.abs(fp8 - plain).mean() < 12     # rounded weights: close, not equal
    assert np.abs(fp8 - run(tiny, fp8=True)).mean() > 2   # the LoRA acts beside the fp8 weights
    # on cuda the budget counts the whole device, as it does for a user: the CUDA context, libraries and what other
    # tests left (~0.6 GiB) come on top of the 96 MiB this run may take in FLAME's pool
    outside, held = _outside_pool(), _held_in_pool()
    budget = outside + held + 96 * 2 ** 20
    stats = {}
    streamed = run(tiny, fp8=True, loras=[loras["kohya"]], max_gpu_memory=f"{budget}B", stats=stats)
    np.testing.assert_array_equal(streamed, fp8)   # streaming moves bytes, it does not change numbers
    assert set(stats) == {"text encoders", "transformer", "vae"}
    for stage, s in stats.items():
        assert 0 < s["peak_bytes"] <= budget - outside, (stage, s)
    if DEVICE == "cuda":  # a budget the device already spends outside the pool: refused before any loading
        with pytest.raises(GenerateError, match="outside FLAME's pool"):
            run(tiny, max_gpu_memory=f"{outside // 2}B")


@pytest.mark.gpu_exclusive  # the budget counts the device's memory outside the pool
def test_fp8_compute_resident_and_streamed(tiny, loras):
    from flame_core.kernels import scaled_mm
    fp8 = run(tiny, fp8=True, loras=[loras["kohya"]])
    scaled_mm.last_path = None
    compute = run(tiny, fp8="compute", loras=[loras["kohya"]])
    assert scaled_mm.last_path is not None                     # the blocks' matmuls went through the fp8 GEMM
    assert 0 < np.abs(compute - fp8).mean() < 12               # activations rounded to e4m3 too: close, not equal
    budget = _outside_pool() + _held_in_pool() + 96 * 2 ** 20
    streamed = run(tiny, fp8="compute", loras=[loras["kohya"]], max_gpu_memory=f"{budget}B")
    if DEVICE == "cpu":
        np.testing.assert_array_equal(streamed, compute)       # streaming moves bytes, it does not change numbers
    else:   # cuBLASLt may pick another fp8 algorithm for a slot's address: bf16 roundings, not other weights
        assert np.abs(streamed.astype(float) - compute).mean() < 0.5
    with pytest.raises(GenerateError, match="fp8: False, True"):
        run(tiny, fp8="int8")


def _held_in_pool():
    """Device bytes the pool holds for live tensors of earlier tests in this process (0 on the cpu): they count
    against a budget as the run's own would."""
    if DEVICE == "cpu":
        return 0
    gc.collect()
    memory.empty_cache(DEVICE)
    return memory.memory_reserved(DEVICE)


def _outside_pool():
    """Device bytes in use outside FLAME's pool (0 on the cpu)."""
    if DEVICE == "cpu":
        return 0
    free, total = flame.cuda.mem_get_info()
    return total - free - memory.memory_reserved(DEVICE)


# ----------------------------------------------------------------------------- bad input: exit 2, the file named
def _fails(capsys, argv, *needles):
    rc = main(argv + ["--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = [l for l in err.splitlines() if l.startswith("error:")]
    assert line, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_inputs_exit_2_naming_the_file(tiny, loras, tmp_path, capsys):
    root = os.path.dirname(tiny.transformer)
    vae_file = os.path.join(tiny.vae, "diffusion_pytorch_model.safetensors")
    out = tmp_path / "out"
    base = ["--prompt", "a cat", "--width", "48", "--height", "32", "--output", str(out)]
    err = _fails(capsys, ["--model", vae_file] + base, vae_file, "is not a Flux transformer: it looks like a VAE")
    assert len(err.strip().splitlines()) == 1
    _fails(capsys, ["--model", loras["kohya"]] + base, loras["kohya"], "looks like a LoRA")
    _fails(capsys, ["--model", tiny.transformer] + base, "vae: missing", "--vae", "--clip-l", "--t5")
    _fails(capsys, ["--model", root, "--lora", vae_file] + base, vae_file, "not a LoRA file")
    _fails(capsys, ["--model", root, "--lora", str(tmp_path / "nope.safetensors:0.5")] + base,
           str(tmp_path / "nope.safetensors"), "no such file")
    _fails(capsys, ["--model", root, "--lora", loras["other_size"]] + base, loras["other_size"],
           "double_blocks.0.img_attn.qkv", "another model size")
    _fails(capsys, ["--model", root, "--prompt", "x", "--width", "50", "--output", str(out)], "--width 50")
    _fails(capsys, ["--model", root, "--output", str(out)], "no prompt")
    _fails(capsys, ["--model", root, "--max-gpu-memory", "lots"] + base, "--max-gpu-memory")
    (tmp_path / "file").write_text("x")
    _fails(capsys, ["--model", root, "--prompt", "x", "--output", str(tmp_path / "file")], "not a folder")
    _fails(capsys, ["--model", root, "--prompts-file", str(tmp_path / "none.txt"), "--output", str(out)],
           str(tmp_path / "none.txt"))
    assert not out.exists() or not os.listdir(out)


def test_a_lora_with_non_finite_weights_exits_2_naming_the_file_and_key(tiny, loras, tmp_path, capsys):
    """A NaN in a LoRA file made black images and exit 0; it is refused before any model is loaded."""
    with safe_open(loras["kohya"]) as f:
        sd = {k: f.get_array(k) for k in f.keys()}
    key = "lora_unet_single_blocks_0_linear1.lora_up.weight"
    sd[key] = sd[key].copy()
    sd[key][0, 0] = np.nan
    bad = str(tmp_path / "nan.safetensors")
    save_file(sd, bad)
    root = os.path.dirname(tiny.transformer)
    out = tmp_path / "out"
    err = _fails(capsys, ["--model", root, "--lora", bad, "--prompt", "x", "--width", "32", "--height", "32",
                          "--output", str(out)], key, "1 of", "not finite")
    line = next(l for l in err.splitlines() if l.startswith("error:"))
    assert line.count(bad) == 1, line
    assert not out.exists() or not os.listdir(out)


def test_guidance_on_a_schnell_like_model_is_refused(tmp_path, capsys):
    files = tiny_flux_files(tmp_path / "schnell", guidance_embed=False)
    root = os.path.dirname(files.transformer)
    _fails(capsys, ["--model", root, "--prompt", "x", "--guidance", "3", "--output", str(tmp_path / "o")],
           "schnell-like", files.transformer)
    assert main(["--model", root, "--prompt", "x", "--width", "32", "--height", "32", "--output",
                 str(tmp_path / "o"), "--no-progress"]) == 0
    im = Image.open(tmp_path / "o" / os.listdir(tmp_path / "o")[0])
    assert "Steps: 4," in im.text["parameters"] and "Distilled CFG" not in im.text["parameters"]
