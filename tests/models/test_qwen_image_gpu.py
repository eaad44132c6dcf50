"""Qwen-Image on a GPU: the transformer (float32 against the CPU, bfloat16 with flash attention at head dim 128 and
the text mask), its gradients with and without checkpointing, the VAE and the Qwen2.5-VL language model against the
CPU, a LoRA run of the tiny family through the trainer (CUDA graphs) on cuda, generate's stages against the CPU from
the same noise (the transformer resident, streamed, in fp8) and generate with fp8 / a budget against its resident
run."""
import os

import numpy as np
import pytest

import flame_core as flame
from flame_models.qwen_image import QwenImageParams, QwenImageTransformer2DModel
from flame_models.qwen_image.vae import AutoencoderKLQwenImage, QwenImageVAEConfig
from flame_models.text_encoders.qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

pytestmark = pytest.mark.gpu

MID = QwenImageParams(num_layers=2, num_attention_heads=4, attention_head_dim=128, joint_attention_dim=256)


def _rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def _pair(model_class, config, seed, dtype=flame.float32):
    """The same random model on the cpu (float32) and on cuda (`dtype`)."""
    flame.manual_seed(seed)
    cpu = model_class(config, dtype=flame.float32, device="cpu")
    gpu = model_class(config, dtype=dtype, device="cuda")
    with flame.no_grad():
        for (_, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
            b.copy_(a.to("cuda").to(dtype))
    return cpu, gpu


def _inputs(p, grid, n_txt=12, valid=(12, 7), seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(2, grid[0] * grid[1], p.in_channels)).astype(np.float32)
    e = rng.normal(size=(2, n_txt, p.joint_attention_dim)).astype(np.float32)
    m = np.zeros((2, n_txt), np.float32)
    for b, n in enumerate(valid):
        m[b, :n] = 1
    return h, e, m, np.array([0.7, 0.2], np.float32)


def _run(model, device, dtype, h, e, m, s, grid):
    t = lambda a: flame.tensor(a, device=device)  # noqa: E731
    with flame.no_grad():
        return model(t(h).to(dtype), t(e).to(dtype), t(m), t(s), [[(1, *grid)]] * h.shape[0]).float().cpu().numpy()


@pytest.mark.parametrize("p, grid, dtype, tol", [
    ("qwen-image-tiny", (5, 4), flame.float32, 1e-4),
    (MID, (16, 12), flame.float32, 1e-4),
    (MID, (16, 12), flame.bfloat16, 3e-2),
])
def test_the_transformer_on_cuda_matches_the_cpu(p, grid, dtype, tol):
    cpu, gpu = _pair(QwenImageTransformer2DModel, p, 0, dtype)
    h, e, m, s = _inputs(cpu.params, grid)
    want = _run(cpu, "cpu", flame.float32, h, e, m, s, grid)
    got = _run(gpu, "cuda", dtype, h, e, m, s, grid)
    assert _rel(got, want) <= tol, _rel(got, want)
    t = lambda a: flame.tensor(a, device="cuda")  # noqa: E731
    with flame.no_grad():
        alone = gpu(t(h[1:]).to(dtype), t(e[1:, :7]).to(dtype), None, t(s[1:]), [[(1, *grid)]]).float().cpu().numpy()
    assert _rel(got[1:], alone) <= max(tol, 1e-4) * 3, _rel(got[1:], alone)      # the mask = the trimmed text


def test_gradients_on_cuda_match_the_cpu_and_checkpointing():
    cpu, gpu = _pair(QwenImageTransformer2DModel, MID, 1)
    h, e, m, s = _inputs(MID, (8, 8))
    grads = []
    for model, device, ckpt in ((cpu, "cpu", False), (gpu, "cuda", False), (gpu, "cuda", True)):
        model.zero_grad()
        model.enable_gradient_checkpointing(ckpt)
        x = flame.tensor(h, device=device, requires_grad=True)
        out = model(x, flame.tensor(e, device=device), flame.tensor(m, device=device), flame.tensor(s, device=device),
                    [[(1, 8, 8)]] * 2)
        (out * out).mean().backward()
        grads.append((x.grad.cpu().numpy(), model.transformer_blocks[0].attn.add_q_proj.weight.grad.cpu().numpy()))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            assert _rel(a, b) <= 1e-3, _rel(a, b)


def test_the_vae_on_cuda_matches_the_cpu():
    cpu, gpu = _pair(AutoencoderKLQwenImage, QwenImageVAEConfig(base_dim=16, num_res_blocks=1), 2)
    x = np.random.default_rng(3).uniform(-1, 1, (1, 3, 64, 48)).astype(np.float32)
    with flame.no_grad():
        z = cpu.encode(flame.tensor(x)).numpy()
        zg = gpu.encode(flame.tensor(x, device="cuda")).cpu().numpy()
        y = cpu.decode(flame.tensor(z)).numpy()
        yg = gpu.decode(flame.tensor(z, device="cuda")).cpu().numpy()
    assert _rel(zg, z) <= 1e-4 and _rel(yg, y) <= 1e-4


def test_the_language_model_on_cuda_matches_the_cpu():
    c = Qwen2_5_VLTextConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1)
    cpu, gpu = _pair(Qwen2_5_VLTextModel, c, 4)
    ids = np.random.default_rng(5).integers(0, 512, (2, 20))
    mask = np.ones((2, 20), np.int64)
    mask[1, 13:] = 0
    with flame.no_grad():
        a = cpu(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.numpy()
        b = gpu(flame.tensor(ids), flame.tensor(mask)).last_hidden_state.cpu().numpy()
    assert _rel(b, a) <= 1e-4, _rel(b, a)


def test_a_tiny_lora_run_on_cuda(tmp_path):
    from flame_models.training.config import config_from_dict
    from flame_models.training.trainer import Trainer
    cfg = config_from_dict({
        "name": "q", "training_folder": str(tmp_path), "device": "cuda",
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4, "target": "all_linear"},
        "synthetic": {"num_samples": 8, "height": 64, "width": 48, "text_length": 8, "seed": 0},
        "train": {"steps": 4, "batch_size": 2, "lr": 3e-3, "lr_warmup_steps": 0, "dtype": "bf16", "seed": 0},
        "model": {"arch": "qwen_image"}, "sample": {"sample_every": 0}, "save": {"save_every": 4}})
    Trainer(cfg, verbose=False).train()
    assert os.path.exists(os.path.join(str(tmp_path), "q", "q.safetensors"))


def _encode(folder, device):
    """The positive and negative prompts' states through the folder's Qwen2.5-VL and tokenizer on `device`."""
    from flame_models.qwen_image.family_parts import QwenImageTextEncoders
    from flame_models.text_encoders.qwen2_5_vl import load_qwen2_5_vl
    from flame_models.tokenization.qwen2 import Qwen2Tokenizer
    te = load_qwen2_5_vl(os.path.join(folder, "text_encoder"), dtype=flame.float32, device=device)
    enc = QwenImageTextEncoders(te, Qwen2Tokenizer.from_folder(os.path.join(folder, "tokenizer")), max_length=64)
    return [{k: v.float().cpu().numpy() for k, v in enc.encode([p]).items()} for p in ("a red square", "blurry")]


def test_the_generate_stages_on_cuda_match_the_cpu_from_the_same_noise(tmp_path):
    """generate's stages on cuda against the cpu, each from the same input: the prompt states, the denoising from
    the same starting latents with the transformer resident, streamed (every block), in fp8, in fp8 and streamed,
    and the VAE. (The images of generate(seed=) are not compared across devices: a seed's noise is drawn on the
    model's device, PCG64 on the cpu and Philox on cuda -- the mean pixel difference 27.7 of this test's first form,
    as large as two seeds' on one device.)"""
    from flame_models.pipeline import load_for_sampling
    from flame_models.qwen_image import sampling as S
    from flame_models.qwen_image.loading import load_qwen_image
    from flame_models.qwen_image.stages import decode_latents
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    from flame_models.qwen_image.vae import load_vae
    folder = tiny_qwen_image_folder(tmp_path / "Qwen-Image-tiny", seed=1)
    (pos, neg), (gpos, gneg) = _encode(folder, "cpu"), _encode(folder, "cuda")
    for a, b in ((gpos, pos), (gneg, neg)):
        np.testing.assert_array_equal(a["prompt_mask"], b["prompt_mask"])
        assert _rel(a["prompt_embeds"], b["prompt_embeds"]) <= 1e-4, _rel(a["prompt_embeds"], b["prompt_embeds"])
    z0 = np.random.default_rng(3).standard_normal((1, 16, 6, 8)).astype(np.float32)
    kw = dict(height=48, width=64, steps=3, cfg=3.0, latents=z0)

    def sample(device, **how):
        model = load_for_sampling(lambda d: load_qwen_image(os.path.join(folder, "transformer"), dtype=flame.float32,
                                                            device=d), folder, [], ("transformer_blocks",), device,
                                  **how)
        return S.sample_latents(model, pos, neg, **kw).float().cpu().numpy()
    want = sample("cpu")
    want_fp8 = sample("cpu", fp8=True)
    for how, ref, tol in (({}, want, 1e-4), ({"stream": True}, want, 1e-4), ({"fp8": True}, want_fp8, 5e-3),
                          ({"fp8": True, "stream": True}, want_fp8, 5e-3)):
        got = sample("cuda", **how)
        assert _rel(got, ref) <= tol, (how, _rel(got, ref))
    vae_cpu = load_vae(os.path.join(folder, "vae"), dtype=flame.float32, device="cpu")
    vae_gpu = load_vae(os.path.join(folder, "vae"), dtype=flame.float32, device="cuda")
    a = decode_latents(vae_cpu, flame.tensor(want)).numpy()
    b = decode_latents(vae_gpu, flame.tensor(want, device="cuda")).cpu().numpy()
    assert _rel(b, a) <= 1e-4, _rel(b, a)


@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("kw", [{"fp8": True}, {"budget": True}, {"fp8": True, "budget": True}])
def test_generate_on_cuda_with_fp8_and_a_budget_matches_the_resident_run(tmp_path, kw):
    """generate on cuda with fp8 storage and / or a budget (both stacks streamed and fitted) against the resident
    float32 run on cuda: the same seed's noise (both on cuda), the same picture up to fp8's rounding. The budget
    counts the whole device (the CUDA context, libraries, other processes): what is held outside FLAME's pool now
    plus 512 MiB for the tiny model's stages."""
    from flame_core import memory
    from flame_models.generate import generate
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    if kw.pop("budget", False):
        free, total = flame.cuda.mem_get_info()
        outside = total - free - memory.memory_reserved("cuda")
        kw["max_gpu_memory"] = f"{outside + 512 * 2 ** 20}B"
    folder = tiny_qwen_image_folder(tmp_path / "Qwen-Image-tiny", seed=1)
    common = dict(width=64, height=48, steps=3, seed=2, negative_prompt="blurry", cfg=3.0, progress=False,
                  log=lambda *a: None, device="cuda", dtype="float32")
    plain = np.asarray(generate(folder, "a red square", **common)[0], np.float32)
    got = np.asarray(generate(folder, "a red square", **common, **kw)[0], np.float32)
    other = np.asarray(generate(folder, "a red square", **{**common, "seed": 3})[0], np.float32)
    assert got.shape == plain.shape == (48, 64, 3)
    assert np.abs(plain - other).mean() > 10.0                  # a seed's noise decides the picture (cpu: 29)
    assert np.abs(got - plain).mean() <= (2.0 if kw.get("fp8") else 0.5)   # the cpu: 0.07 with fp8, 0 without
