"""Qwen-Image on a GPU: the transformer (float32 against the CPU, bfloat16 with flash attention at head dim 128 and
the text mask), its gradients with and without checkpointing, the VAE and the Qwen2.5-VL language model against the
CPU, and a LoRA run of the tiny family through the trainer (CUDA graphs) on cuda."""
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


@pytest.mark.parametrize("kw", [{}, {"fp8": True}, {"max_gpu_memory": "4GiB"}])
def test_generate_on_cuda_with_fp8_and_streamed_blocks(tmp_path, kw):
    from flame_models.generate import generate
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    folder = tiny_qwen_image_folder(tmp_path / "Qwen-Image-tiny", seed=1)
    common = dict(width=64, height=48, steps=3, seed=2, negative_prompt="blurry", cfg=3.0, progress=False,
                  log=lambda *a: None)
    cpu = np.asarray(generate(folder, "a red square", device="cpu", **common)[0], np.float32)
    gpu = np.asarray(generate(folder, "a red square", device="cuda", dtype="float32", **common, **kw)[0], np.float32)
    assert gpu.shape == cpu.shape == (48, 64, 3)
    assert np.abs(gpu - cpu).mean() <= (8.0 if kw.get("fp8") else 1.0)      # 8-bit images; fp8 weights differ
