"""The Flux LoRA trainer end to end on a tiny Flux: the loss falls, the outputs are written and load back, a restart
resumes exactly (the next step's loss and parameters equal the uninterrupted run's), and on a GPU the CUDA-graph
step gives the eager step's numbers."""
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models.training.config import config_from_dict
from flame_models.training.trainer import Trainer


def cfg(tmp_path, name, device="cpu", steps=6, **train):
    gpu = device.startswith("cuda")
    t = {"steps": steps, "batch_size": 2, "optimizer": "adamw", "lr": 3e-3, "lr_warmup_steps": 2,
         "dtype": "bf16" if gpu else "fp32", "gradient_checkpointing": False, "seed": 0}
    t.update(train)
    return config_from_dict({
        "name": name, "training_folder": str(tmp_path), "device": device,
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4, "target": "all_linear"},
        "synthetic": {"num_samples": 8, "height": 32, "width": 32, "text_length": 8, "seed": 0},
        "train": t, "model": {"size": "flux-tiny", "dtype": "bf16" if gpu else "fp32"},
        "sample": {"sample_every": 0}, "save": {"save_every": 3, "format": "kohya", "dtype": "fp32"}})


def test_tiny_run_lowers_the_loss_and_writes_its_outputs(tmp_path):
    result = Trainer(cfg(tmp_path, "fall", steps=120), verbose=False).train()
    losses = np.array(result["losses"])
    assert len(losses) == 120 and np.isfinite(losses).all()
    assert losses[:20].mean() > 1.25 * losses[-20:].mean(), (losses[:20].mean(), losses[-20:].mean())
    for key in ("lora", "loss_csv", "loss_json", "loss_plot"):
        assert os.path.getsize(result[key]) > 0, key
    tensors = io.load_file(result["lora"])
    assert any(k.endswith(".lora_down.weight") for k in tensors) and any(k.endswith(".alpha") for k in tensors)


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


@pytest.mark.gpu
def test_cuda_graph_steps_give_the_eager_numbers(tmp_path):
    runs = {}
    for graph in (False, True):
        tr = Trainer(cfg(tmp_path, f"graph{graph}", device="cuda", cuda_graph=graph), verbose=False).setup()
        losses = [tr.train_step()[0] for _ in range(6)]
        runs[graph] = (losses, [p.detach().float().numpy() for p in tr.params], tr)
    assert runs[True][2].graphed is not None and runs[True][2].graphed.graph is not None  # it did capture
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


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


@pytest.mark.gpu
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
