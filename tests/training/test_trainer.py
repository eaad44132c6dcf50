"""The trainer end to end on a tiny Flux: the loss falls, the outputs are written and load back, a restart resumes
exactly (the next step's loss and parameters equal the uninterrupted run's), on a GPU the CUDA-graph step gives the
eager step's numbers -- and the loop itself knows no model: a toy family registered by the test trains through it."""
import ast
import os
import re

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import io
from flame_models.training import register_family
from flame_models.training.config import config_from_dict
from flame_models.training.family import ModelFamily
from flame_models.training.objective import FlowMatching
from flame_models.training.trainer import Trainer

from .conftest import tiny_config

TRAINING = os.path.join(os.path.dirname(__file__), "..", "..", "flame_models", "training")


def cfg(tmp_path, name, device="cpu", steps=6, **train):
    c = tiny_config(tmp_path, name, steps=steps, train=train)
    if device.startswith("cuda"):
        c.device, c.train.dtype, c.model.dtype = device, "bf16", "bf16"
    return c


def test_tiny_run_lowers_the_loss_and_writes_its_outputs(tmp_path):
    result = Trainer(cfg(tmp_path, "fall", steps=120), verbose=False).train()
    losses = np.array(result["losses"])
    assert len(losses) == 120 and np.isfinite(losses).all()
    assert losses[:20].mean() > 1.25 * losses[-20:].mean(), (losses[:20].mean(), losses[-20:].mean())
    for key in ("lora", "loss_csv", "loss_json", "loss_plot"):
        assert os.path.getsize(result[key]) > 0, key
    tensors = io.load_file(result["lora"])
    assert any(k.endswith(".lora_down.weight") for k in tensors) and any(k.endswith(".alpha") for k in tensors)
    meta = io.load_metadata(result["lora"])
    assert meta["modelspec.architecture"] == "flux-1-dev/lora" and meta["flame.steps"] == "120"


def test_restart_resumes_exactly(tmp_path):
    full = Trainer(cfg(tmp_path, "full"), verbose=False).setup()
    for _ in range(3):
        full.train_step()
    full.save_checkpoint()
    want_loss = [full.train_step()[0] for _ in range(2)]
    want = [p.detach().numpy().copy() for p in full.params]

    again = Trainer(cfg(tmp_path, "full"), verbose=False).setup()   # same output folder: picks up step 3
    assert again.resumed_from and again.step == 3
    got_loss = [again.train_step()[0] for _ in range(2)]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for a, b in zip(again.params, want):
        np.testing.assert_allclose(a.detach().numpy(), b, rtol=1e-6, atol=1e-7)


def test_adapter_gradients_are_resident_only_from_backward_to_zero_grad(tmp_path):
    """One micro-step per step, one process: lazy gradient buffers (PyTorch's memory behaviour), so no gradient
    storage sits under the next step's activations; with accumulation the buffers stay (they sum micro-steps)."""
    from flame_core import grad_pool
    tr = Trainer(cfg(tmp_path, "lazy"), verbose=False).setup()
    bufs = {id(grad_pool.buffer_of(p)): grad_pool.buffer_of(p) for p in tr.params}.values()
    assert all(b.lazy for b in bufs) and not any(b.resident for b in bufs)
    tr.train_step()
    assert all(p.grad is None for p in tr.params) and not any(b.resident for b in bufs)
    acc = Trainer(cfg(tmp_path, "accumulate", gradient_accumulation_steps=2), verbose=False).setup()
    assert not any(grad_pool.buffer_of(p).lazy for p in acc.params)


@pytest.mark.gpu
def test_cuda_graph_steps_give_the_eager_numbers(tmp_path):
    runs = {}
    for graph in (False, True):
        tr = Trainer(cfg(tmp_path, f"graph{graph}", device="cuda", cuda_graph=graph), verbose=False).setup()
        losses = [tr.train_step()[0] for _ in range(6)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    g = runs[True][2].graphed
    assert g is not None and g.graph is not None, f"no capture: {g and g.failure}"  # it did capture
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_cuda_graph_steps_survive_sampling_ema_and_a_checkpoint(tmp_path):
    # the graph replays over the parameters' storage: EMA swaps, sampling and saving in between must not break it
    runs = {}
    for graph in (False, True):
        c = cfg(tmp_path, f"graph_all{graph}", device="cuda", steps=8, cuda_graph=graph)
        c.train.ema_config.use_ema, c.sample.sample_every, c.sample.sample_steps = True, 4, 3
        tr = Trainer(c, verbose=False)
        result = tr.train()
        runs[graph] = (result["losses"], [p.detach().float().numpy() for p in tr.params], tr)
    assert runs[True][2].graphed.graph is not None, runs[True][2].graphed.why
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu_exclusive
@pytest.mark.gpu
def test_cuda_graph_steps_with_streamed_blocks_give_the_eager_numbers(tmp_path):
    # max_gpu_memory set: the blocks stream through a BlockStreamer and the graph captures the copies too
    import flame_core.memory as M
    runs = {}
    for graph in (False, True):
        c = cfg(tmp_path, f"stream_graph{graph}", device="cuda", cuda_graph=graph, gradient_checkpointing=True)
        c.max_gpu_memory = "8GiB"
        tr = Trainer(c, verbose=False).setup()
        M.set_memory_limit(None, "cuda")
        tr.streamer.set_resident([1])  # flux-tiny fits whole: stream 3 of its 4 blocks through the 2 slots
        losses = [tr.train_step()[0] for _ in range(6)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    tr = runs[True][2]
    assert tr.graphed is not None and tr.graphed.graph is not None  # it did capture, with blocks streaming
    assert tr.streamer.streamed == [0, 2, 3] and tr.streamer.graph_stats["loads"] > 0
    assert tr.streamer.graph_stats["start"] == tr.streamer.graph_stats["end"]
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_model_quantize_stores_the_blocks_in_fp8_and_still_trains(tmp_path):
    from flame_nn.offload import is_fp8_linear
    c = cfg(tmp_path, "fp8", steps=60)
    c.model.quantize = True
    tr = Trainer(c, verbose=False)
    result = tr.train()
    fp8 = [n for n, m in tr.model.named_modules() if is_fp8_linear(m)]
    blocks = [n for n, m in tr.model.named_modules() if n.startswith(("double_blocks.", "single_blocks."))
              and type(m).__name__.endswith("Linear")]
    assert fp8 and set(fp8) == set(blocks)                       # every block Linear, none outside the blocks
    assert not any(is_fp8_linear(m) for n, m in tr.model.named_modules() if n in ("img_in", "final_layer.linear"))
    assert all(p.dtype is flame.float32 for p in tr.params)     # the adapters keep their dtype
    losses = np.array(result["losses"])
    assert np.isfinite(losses).all() and losses[:15].mean() > 1.1 * losses[-15:].mean()


def test_fp8_compute_runs_the_block_matmuls_in_fp8_and_trains(tmp_path):
    # the CPU emulates the fp8 GEMM (e4m3 operands, float32 accumulation): the same option as on Hopper's tensor cores
    from flame_core.kernels import scaled_mm
    from flame_nn.offload import is_fp8_linear
    c = cfg(tmp_path, "fp8c", steps=60)
    c.model.quantize, c.train.fp8_compute = True, True
    tr = Trainer(c, verbose=False)
    scaled_mm.last_path = None
    result = tr.train()
    fp8 = [m for m in tr.model.modules() if is_fp8_linear(m)]
    assert fp8 and all(m.fp8_compute for m in fp8)
    assert all(len(set(m.weight_scale.numpy().tolist())) == 1 for m in fp8)   # one scale per weight tensor
    assert scaled_mm.last_path == "emulated"                                   # the fp8 GEMM ran
    losses = np.array(result["losses"])
    assert np.isfinite(losses).all() and losses[:15].mean() > 1.1 * losses[-15:].mean()


def test_checkpoint_save_attention_keeps_the_blocks_attention_and_trains_the_same(tmp_path, monkeypatch):
    # train.checkpoint_save: attention -> every checkpointed block keeps its attention outputs; the recompute runs
    # no attention forward and the losses equal full checkpointing's
    from flame_core.kernels import attention as K
    calls = [0]
    real = K.flash_attention_forward
    monkeypatch.setattr(K, "flash_attention_forward",
                        lambda *a, **kw: calls.__setitem__(0, calls[0] + 1) or real(*a, **kw))
    losses, counts = {}, {}
    for save in ("none", "attention"):
        c = cfg(tmp_path, f"save{save}", steps=4)
        c.train.gradient_checkpointing, c.train.checkpoint_save = True, save
        tr = Trainer(c, verbose=False)
        calls[0] = 0
        losses[save] = np.array(tr.train()["losses"])
        counts[save] = calls[0]
        blocks = tr.model.checkpointed_blocks()
        assert all(b.checkpoint_save == (() if save == "none" else ("attention",)) for b in blocks)
    np.testing.assert_array_equal(losses["none"], losses["attention"])
    assert counts["attention"] * 2 == counts["none"] > 0   # forwards once per block, not twice


@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_fp8_delayed_scaling_is_set_on_every_fp8_layer_and_trains(tmp_path, budget):
    # resident blocks, and blocks packed by the streamer under max_gpu_memory (quantised at packing)
    from flame_nn.offload import is_fp8_linear
    c = cfg(tmp_path, f"fp8d{budget}", steps=60)
    c.model.quantize, c.train.fp8_compute, c.train.fp8_scaling = True, True, "delayed"
    c.max_gpu_memory = budget
    tr = Trainer(c, verbose=False)
    result = tr.train()
    fp8 = [m for m in tr.model.modules() if is_fp8_linear(m)]
    assert fp8 and all(m.__dict__.get("_fp8_sites") is not None for m in fp8)
    assert all(m._fp8_sites.x.state is not None for m in fp8)   # every site was used
    losses = np.array(result["losses"])
    assert np.isfinite(losses).all() and losses[:15].mean() > 1.1 * losses[-15:].mean()


@pytest.mark.gpu_exclusive
@pytest.mark.gpu
def test_fp8_compute_on_cuda_resident_and_under_a_budget(tmp_path):
    # bf16 with CUDA graphs (the trainer's defaults on cuda): the blocks' matmuls through cuBLASLt's fp8 GEMM, the
    # blocks resident, then packed by the streamer under max_gpu_memory; the two runs compute the same numbers
    from flame_core.kernels import scaled_mm
    losses = {}
    for budget in (None, "8GiB"):
        c = cfg(tmp_path, f"fp8c{budget}", device="cuda", steps=8)
        c.model.quantize, c.train.fp8_compute, c.max_gpu_memory = True, True, budget
        scaled_mm.last_path = None
        losses[budget] = np.array(Trainer(c, verbose=False).train()["losses"])
        assert scaled_mm.last_path == "cublaslt"
        assert np.isfinite(losses[budget]).all()
    np.testing.assert_allclose(losses["8GiB"], losses[None], rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.gpu_exclusive  # a max_gpu_memory budget: other processes' memory counts against it
def test_a_capture_over_the_budget_streams_more_blocks_and_captures_again(tmp_path):
    # the first capture raises OutOfMemoryError (as a capture over max_gpu_memory does): the trainer demotes resident
    # blocks, runs that step eagerly and captures at the next step; the numbers stay the eager run's
    import flame_core.memory as M
    from flame_core.cuda import is_capturing
    from flame_core.errors import OutOfMemoryError
    runs = {}
    for graph in (False, True):
        c = cfg(tmp_path, f"demote{graph}", device="cuda", cuda_graph=graph, gradient_checkpointing=True)
        c.max_gpu_memory = "8GiB"
        tr = Trainer(c, verbose=False).setup()
        M.set_memory_limit(None, "cuda")
        tr.streamer.set_resident([0, 1, 2, 3])
        if graph:
            fn, fails = tr.graphed.fn, []

            def flaky(*args):
                if is_capturing() and not fails:
                    fails.append(1)
                    raise OutOfMemoryError("pretend: the capture went over the budget")
                return fn(*args)
            tr.graphed.fn = flaky
        losses = [tr.train_step()[0] for _ in range(6)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    tr = runs[True][2]
    assert tr._graph_demotions == 1 and len(tr.streamer.resident) == 3  # 1 of the 4 demoted
    assert tr.graphed.enabled and tr.graphed.graph is not None      # captured at the step after
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- model-agnostic
def test_the_loop_imports_no_model_and_no_private_surface():
    loop = ("trainer.py", "checkpoint.py", "resume.py", "samples.py", "config.py", "validation.py",
            "logging.py", "progress.py", "ema.py", "preview.py", "interrupt.py", "run_folder.py",
            "objective.py", "timesteps.py", "family.py", "model_files.py", "network.py", "lr_schedule.py")
    private = re.compile(r"\._data\b|\b_wrap\b|_view_of|\._version\b|\._generation\b|grad_mode\.|kernels\.\w+\._")
    for name in loop:
        src = open(os.path.join(TRAINING, name)).read()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any("flux" in m for m in mods), (name, mods)
        assert not private.search(src), (name, private.search(src).group(0))
    # the families' trainer plug-ins (each in its folder) and what they share
    models = os.path.dirname(TRAINING)
    plugins = [os.path.join(TRAINING, "family_base.py"), os.path.join(TRAINING, "family_parts.py")]
    plugins += [os.path.join(models, fam, name) for fam in ("bfl", "sd3", "sdxl", "chroma")
                for name in ("family.py", "family_parts.py")]                  # (bfl: Flux's, shared)
    plugins += [os.path.join(models, "flux", "family.py"), os.path.join(models, "flux_kontext", "family.py")]
    for path in plugins:
        src = open(path).read()
        assert not private.search(src), (path, private.search(src).group(0))


class ToyModel(flame_nn.Module):
    """A tiny denoiser on unpacked 4-channel latents (SD3-like layout: no packing), conditioned on one vector."""

    def __init__(self, channels=4, cond_dim=6, hidden=16):
        super().__init__()
        self.inp = flame_nn.Linear(channels + cond_dim + 1, hidden)
        self.blocks = flame_nn.ModuleList([flame_nn.Linear(hidden, hidden) for _ in range(2)])
        self.out = flame_nn.Linear(hidden, channels)

    def enable_gradient_checkpointing(self, enabled=True):
        return self

    def forward(self, x, t, emb):                                  # x (B, C, h, w)
        B, C, h, w = x.shape
        tokens = x.permute(0, 2, 3, 1).reshape(B, h * w, C)
        extra = flame.cat([emb, t.reshape(B, 1)], dim=-1).reshape(B, 1, -1).expand(B, h * w, emb.shape[-1] + 1)
        y = self.inp(flame.cat([tokens, extra], dim=-1))
        for blk in self.blocks:
            y = y + flame_nn.functional.silu(blk(y))
        return self.out(y).reshape(B, h, w, C).permute(0, 3, 1, 2)


class ToyFamily(ModelFamily):
    name, latent_channels, pixel_multiple = "toy", 4, 16
    noise_schedulers, samplers, default_size, model_sizes = ("flowmatch",), ("euler",), "toy", ("toy",)
    sample_keys = ("latents", "emb")
    target_presets, default_target = {"all": ["blocks.*"]}, "all"

    def describe_model(self, model_cfg):
        return {"cond_dim": 6}

    def check_sample(self, shapes, spec):
        return None

    def synthetic_conditioning(self, spec, text_length):
        return {"emb": (spec["cond_dim"],)}

    def build_model(self, model_cfg, spec, dtype, device):
        flame.manual_seed(5)
        return ToyModel(cond_dim=spec["cond_dim"]).to(device=device, dtype=dtype)

    def spec_of(self, model):
        return {"cond_dim": 6}

    def block_stacks(self, model):
        return ["blocks"]

    def lora_name_map(self, model):
        from flame_nn.adapters.formats import IDENTITY
        return IDENTITY

    def lora_metadata(self, cfg, model):
        return {"flame.family": "toy"}

    def objective(self, train_cfg):
        return FlowMatching(train_cfg.timestep_type)

    def training_inputs(self, model, batch, device, train_cfg):
        return (flame.tensor(batch["latents"], device=device),
                {"emb": flame.tensor(batch["emb"], device=device)})

    def image_seq_len(self, x0):
        return x0.shape[2] * x0.shape[3]

    def forward(self, model, x_t, t, cond):
        return model(x_t, t, cond["emb"])

    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None):
        g = flame.Generator(device).manual_seed(seed)
        x = flame.randn(1, 4, height // 8, width // 8, generator=g, device=device)
        emb = flame.tensor(cond["emb"][None], device=device)
        for i in range(steps):
            t = 1.0 - i / steps
            x = x - (1.0 / steps) * model(x, flame.full((1,), t, device=device), emb)
            if callback:
                callback(i + 1, steps)
        return x


def test_a_family_registered_from_outside_trains_resumes_and_samples_through_the_same_loop(tmp_path):
    register_family("toy", ToyFamily())

    def toy(name, steps):
        return config_from_dict({
            "name": name, "training_folder": str(tmp_path), "device": "cpu",
            "model": {"arch": "toy", "dtype": "fp32"}, "network": {"linear": 4, "linear_alpha": 4},
            "synthetic": {"num_samples": 8, "height": 32, "width": 32},
            "train": {"steps": steps, "batch_size": 2, "optimizer": "adamw", "lr": 1e-2, "dtype": "fp32",
                      "noise_scheduler": "flowmatch", "seed": 0},
            "sample": {"sample_every": 20, "sample_steps": 4, "num_samples": 2, "sampler": "euler"},
            "save": {"save_every": 20, "format": "kohya", "dtype": "fp32"}})
    result = Trainer(toy("toy", 40), verbose=False).train()
    losses = np.array(result["losses"])
    assert losses[:10].mean() > losses[-10:].mean()
    assert io.load_metadata(result["lora"])["flame.family"] == "toy"
    assert any(k.startswith("lora_unet_blocks_0") for k in io.load_file(result["lora"]))
    assert os.path.isfile(result["samples"])

    full = Trainer(toy("toy_full", 8), verbose=False).setup()
    for _ in range(4):
        full.train_step()
    full.save_checkpoint()
    want = [full.train_step()[0] for _ in range(2)]
    again = Trainer(toy("toy_full", 8), verbose=False).setup()
    assert again.step == 4
    np.testing.assert_allclose([again.train_step()[0] for _ in range(2)], want, rtol=1e-6)


def test_a_budgeted_run_holds_its_limit_while_training_and_gives_it_back(tmp_path):
    # auto_fit leaves max_gpu_memory as the pool's limit; the trainer keeps it while it trains and puts the limit
    # from before back when train() returns (a run that has ended does not leave the process capped)
    from flame_core import memory as M
    c = cfg(tmp_path, "capped", steps=3)
    c.max_gpu_memory = "1GiB"
    tr = Trainer(c, verbose=False).setup()
    assert tr.fit is not None and M.get_memory_limit(c.device) is not None   # fitted: the limit in force
    seen = []
    step = tr.train_step
    tr.train_step = lambda: (seen.append(M.get_memory_limit(c.device)), step())[1]
    M.set_memory_limit("3GiB", c.device)   # changed between setup and train: the fit's limit comes back for training
    tr.train()
    assert tr._fit_limit is not None and len(seen) == 3 and all(s == tr._fit_limit for s in seen)
    assert M.get_memory_limit(c.device) is None   # as before the fit
    M.set_memory_limit("8GiB", c.device)
    try:
        other = Trainer(cfg(tmp_path, "capped2", steps=3), verbose=False)
        other.cfg.max_gpu_memory = "1GiB"
        other.train()
        assert M.get_memory_limit(c.device) == 8 << 30   # a limit the user had set before is what comes back
    finally:
        M.set_memory_limit(None, c.device)
