"""The SD3 joint blocks under flame_nn.offload: block streaming (the pre-only last block returns no context) with a
LoRA trained through it, and fp8 storage of the frozen Linears."""
import numpy as np
from sd3_helpers import diffusers_dir, inputs, io, npy, rel_err

import flame_core as flame
import flame_nn.adapters as A
from flame_models.sd3 import TARGET_PRESETS, load_sd3, name_map_for
from flame_nn.offload import BlockStreamer
from flame_nn.offload.fp8 import quantize_linear_weights_


def tiny_with_lora(device):
    model = load_sd3(diffusers_dir("dual"), dtype=flame.float32, device=device)
    A.inject_adapters(model, TARGET_PRESETS["attention_all"], rank=4, alpha=4.0, name_map=name_map_for(model.params),
                      init_weights="gaussian", generator=flame.Generator("cpu").manual_seed(1))
    rng = np.random.default_rng(2)
    with flame.no_grad():  # a non-zero up-projection, so the adapters change the output and all get gradients
        for _, p in A.named_adapter_parameters(model):
            p.copy_(flame.tensor(0.05 * rng.standard_normal(tuple(p.shape)), dtype=p.dtype, device=p.device))
    return model


def test_streamed_joint_blocks_equal_resident_with_a_lora(device):
    args = inputs(io("dual"), flame.float32, device)
    results = []
    for stream in (False, True):
        model = tiny_with_lora(device)
        model.enable_gradient_checkpointing(not stream)  # streamed blocks checkpoint by themselves
        if stream:
            st = BlockStreamer.for_model(model, device=device, slots=1)
            assert st.names == ["joint_blocks.0", "joint_blocks.1"] and st.streamed == [0, 1]
        params = A.named_adapter_parameters(model)
        steps = []
        for _ in range(2):
            for _, p in params:
                p.grad = None
            out = model(*args)
            (out * out).mean().backward()
            steps.append((npy(out), {k: npy(p.grad) for k, p in params}))
        with flame.no_grad():
            steps.append((npy(model(*args, skip_layers=[0])), {}))
        results.append(steps)
    for (o0, g0), (o1, g1) in zip(*results):
        np.testing.assert_allclose(o1, o0, rtol=1e-6, atol=1e-6)
        assert sorted(g0) == sorted(g1)
        for k in g0:  # the pre-only block's context queries (add_q_proj) are discarded: their LoRA learns nothing
            assert (np.abs(g0[k]).max() > 0) != k.startswith("joint_blocks.1.context_block.attn.qkv[0:16]"), k
            np.testing.assert_allclose(g1[k], g0[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_fp8_storage_of_the_joint_blocks(device):
    arrays = io("dual")
    args = inputs(arrays, flame.float32, device)
    model = load_sd3(diffusers_dir("dual"), dtype=flame.float32, device=device)
    model.requires_grad_(False)
    quantized = quantize_linear_weights_(model.joint_blocks)
    # per block: x (qkv, proj, fc1, fc2, adaLN) + context (qkv, proj, fc1, fc2, adaLN), attn2 (qkv, proj) in block 0,
    # the pre-only context stream of block 1 has only qkv and adaLN
    assert len(quantized) == (10 + 2) + (5 + 2)
    with flame.no_grad():
        out = npy(model(*args))
    err = rel_err(out, arrays["out_f32"])
    assert 1e-3 < err < 0.1, err  # fp8 weights (about 2.6 % per layer), not the float32 result, and not garbage
