"""checkpoint_io.fp8_on_read: a model loaded for fp8 storage (generate --fp8: pipeline.load_for_sampling) gets its
blocks' Linear weights in fp8 as they are read -- the same numbers quantize_linear_weights_ gives after a plain
load, a file's own fp8 bytes and scales kept as stored, and host memory for the fp8 bytes instead of the model's
dtype."""
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from test_scaled_fp8 import _scaled, _tensors

import flame_core as flame
import flame_nn
from flame_core import io
from flame_core.ops.fp8 import quantize_fp8
from flame_models import checkpoint_io as CIO
from flame_models.flux import Flux, flux_params, load_flux, save_flux
from flame_models.flux import keys as K
from flame_nn.offload import is_fp8_linear, quantize_linear_weights_
from flame_nn.offload.fp8 import release_scratch

STACKS = ("double_blocks", "single_blocks")


@pytest.fixture(autouse=True)
def _fresh_scratch():
    """The fp8 layers made here note their sizes for the dequantisation scratch (process-wide): forgotten after
    each test, so that a later test's budget does not count a scratch sized for these models."""
    yield
    release_scratch()
WIDE = flux_params("flux-tiny").replace(hidden_size=256, num_heads=8)   # block weights dominate its bytes


def _file(tmp_path, params, layout="bfl", seed=0):
    rng = np.random.default_rng(seed)
    with flame_nn.empty_init(dtype=flame.float32, device="cpu"):
        model = Flux(params)
    model.load_state_dict({k: (0.05 * rng.standard_normal(s)).astype(np.float32)
                           for k, s in K.bfl_shapes(params).items()})
    path = str(tmp_path / f"flux_{layout}.safetensors")
    save_flux(model, path, layout=layout)
    return path


def _fp8_layers(model):
    return {n: m for n, m in model.named_modules() if is_fp8_linear(m)}


@pytest.mark.parametrize("per_tensor", [False, True])
def test_the_weights_read_are_the_ones_quantising_after_the_load_gives(tmp_path, per_tensor):
    path = _file(tmp_path, flux_params("flux-tiny"))
    after = load_flux(path, dtype=flame.float32, device="cpu").requires_grad_(False)
    for s in STACKS:
        quantize_linear_weights_(after.get_submodule(s), compute="fp8" if per_tensor else None)
    with CIO.fp8_on_read(STACKS, per_tensor=per_tensor):
        read = load_flux(path, dtype=flame.float32, device="cpu")
    if per_tensor:   # as place_for_inference does for fp8="compute": the layers switch, their bytes stay
        before = {n: m.weight.view(flame.uint8).numpy().copy() for n, m in _fp8_layers(read).items()}
        for s in STACKS:
            quantize_linear_weights_(read.get_submodule(s), compute="fp8")
        for n, m in _fp8_layers(read).items():
            assert m.fp8_compute
            np.testing.assert_array_equal(m.weight.view(flame.uint8).numpy(), before[n], err_msg=n)
    want, got = _fp8_layers(after), _fp8_layers(read)
    assert sorted(got) == sorted(want) and len(got) >= 14
    assert all(n.startswith(STACKS) for n in got) and not is_fp8_linear(read.img_in)   # only the blocks
    for n, m in got.items():
        np.testing.assert_array_equal(m.weight.view(flame.uint8).numpy(), want[n].weight.view(flame.uint8).numpy(),
                                      err_msg=n)
        np.testing.assert_array_equal(m.weight_scale.numpy(), want[n].weight_scale.numpy(), err_msg=n)
        assert m.compute_dtype == flame.float32 and not m.weight.requires_grad
    ids = {k: flame.tensor(v, device="cpu") for k, v in _inputs(flux_params("flux-tiny")).items()}
    with flame.no_grad():
        np.testing.assert_array_equal(read(**ids).numpy(), after(**ids).numpy())


def _inputs(p):
    rng = np.random.default_rng(3)
    img_ids = np.zeros((1, 4, 3), np.float32)
    img_ids[0, :, 1], img_ids[0, :, 2] = [0, 0, 1, 1], [0, 1, 0, 1]
    return dict(img=rng.standard_normal((1, 4, p.in_channels)).astype(np.float32), img_ids=img_ids,
                txt=rng.standard_normal((1, 3, p.context_in_dim)).astype(np.float32),
                txt_ids=np.zeros((1, 3, 3), np.float32), timesteps=np.array([0.5], np.float32),
                y=rng.standard_normal((1, p.vec_in_dim)).astype(np.float32), guidance=np.array([3.5], np.float32))


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_a_files_fp8_bytes_and_scales_are_kept_as_stored(tmp_path, layout):
    """ComfyUI's scaled fp8 (per-tensor and per-row scales) in BFL's layout, and diffusers' (q, k, v stored apart:
    the fused qkv weight is their bytes and scales concatenated): nothing re-rounded."""
    p = flux_params("flux-tiny")
    stored, _ = _scaled(_tensors(_file(tmp_path, p, layout)))
    path = str(tmp_path / "scaled.safetensors")
    io.save_file(stored, path)
    with CIO.fp8_on_read(STACKS):
        model = load_flux(path, dtype=flame.float32, device="cpu")
    layers = _fp8_layers(model)
    assert len(layers) >= 14

    def stored_rows(key):
        q = stored[key].view(np.uint8)
        layer = key[:-len(".weight")]
        s = stored.get(layer + ".scale_weight", stored.get(layer + ".weight_scale"))
        return q, np.broadcast_to(np.asarray(s, np.float32).reshape(-1), (q.shape[0],))

    if layout == "bfl":
        pairs = {"double_blocks.1.img_attn.qkv": ["double_blocks.1.img_attn.qkv.weight"],
                 "single_blocks.0.linear2": ["single_blocks.0.linear2.weight"]}
    else:
        pairs = {"double_blocks.1.img_attn.qkv": [f"transformer_blocks.1.attn.to_{c}.weight" for c in "qkv"],
                 "single_blocks.0.linear2": ["single_transformer_blocks.0.proj_out.weight"]}
    for name, keys in pairs.items():
        q = np.concatenate([stored_rows(k)[0] for k in keys])
        s = np.concatenate([stored_rows(k)[1] for k in keys])
        m = layers[name]
        np.testing.assert_array_equal(m.weight.view(flame.uint8).numpy(), q, err_msg=name)
        np.testing.assert_array_equal(m.weight_scale.numpy(), s, err_msg=name)


def test_host_memory_is_the_fp8_bytes(tmp_path):
    path = _file(tmp_path, WIDE)
    block_bytes = sum(int(np.prod(s)) * 4 for k, s in K.bfl_shapes(WIDE).items()
                      if k.startswith(STACKS) and k.endswith(".weight") and len(s) == 2)

    def peak(fp8):
        tracemalloc.start()
        try:
            if fp8:
                with CIO.fp8_on_read(STACKS):
                    model = load_flux(path, dtype=flame.float32, device="cpu")
            else:
                model = load_flux(path, dtype=flame.float32, device="cpu")
            return tracemalloc.get_traced_memory()[1], model
        finally:
            tracemalloc.stop()

    plain, _ = peak(False)
    fp8, model = peak(True)
    assert plain > block_bytes                               # the plain load holds the blocks in float32
    # fp8: a quarter of their bytes, plus one weight read and quantised at a time (its float32 temporaries)
    largest = max(int(np.prod(s)) * 4 for k, s in K.bfl_shapes(WIDE).items() if k.startswith(STACKS))
    assert fp8 < block_bytes / 4 + (plain - block_bytes) + 5 * largest, (fp8, plain, block_bytes, largest)
    assert fp8 < 0.6 * plain
    assert len(_fp8_layers(model)) >= 14


def test_generate_fp8_with_a_dora(tmp_path):
    """A DoRA LoRA beside fp8-stored blocks (read as they are read: fp8_on_read) gives the output of the model with
    the DoRA merged into float weights, up to fp8's rounding of the base weights."""
    from flame_models.flux.lora_keys import TARGET_PRESETS, name_map_for
    from flame_models.pipeline import load_for_sampling
    from flame_nn import adapters as A
    path = _file(tmp_path, flux_params("flux-tiny"))
    model = load_flux(path, dtype=flame.float32, device="cpu")
    A.inject_adapters(model, TARGET_PRESETS["attention"], "dora", rank=2, name_map=name_map_for(model.params))
    rng = np.random.default_rng(4)
    with flame.no_grad():
        for _, p in A.named_adapter_parameters(model):
            p.copy_(p + flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32), device="cpu"))
    dora = A.save_adapters(model, str(tmp_path / "dora.safetensors"), format="kohya")

    def load(dev):
        return load_flux(path, dtype=flame.float32, device=dev)
    fp8 = load_for_sampling(load, path, [(dora, 1.0)], list(STACKS), "cpu", fp8=True)
    merged = load_for_sampling(load, path, [(dora, 1.0)], list(STACKS), "cpu")       # merged, no fp8
    bare = load_for_sampling(load, path, [], list(STACKS), "cpu", fp8=True)
    plain = load_for_sampling(load, path, [], list(STACKS), "cpu")
    assert _fp8_layers(fp8) and not _fp8_layers(merged)
    ids = {k: flame.tensor(v, device="cpu") for k, v in _inputs(flux_params("flux-tiny")).items()}
    with flame.no_grad():
        a, b, c, d = (m(**ids).numpy() for m in (fp8, merged, bare, plain))
    rounding = np.abs(c - d).max()                  # what fp8 storage alone changes
    assert np.abs(a - c).max() > 4 * rounding       # the DoRA acts beside the fp8 blocks ...
    assert np.abs(a - b).max() < 2 * rounding       # ... as it does merged into float weights


def test_a_float8_e5m2_weight_is_quantised_from_its_values(tmp_path):
    """Only float8_e4m3fn bytes are fp8 storage's own: a weight stored as e5m2 is read as its values and
    quantised per row, as a bfloat16 one is."""
    p = flux_params("flux-tiny")
    state = _tensors(_file(tmp_path, p))
    key = "double_blocks.0.img_mlp.0.weight"
    state[key] = state[key].astype(ml_dtypes.float8_e5m2)
    path = str(tmp_path / "e5m2.safetensors")
    io.save_file(state, path)
    with CIO.fp8_on_read(STACKS):
        model = load_flux(path, dtype=flame.float32, device="cpu")
    m = model.double_blocks[0].img_mlp[0]
    q, s = quantize_fp8(flame.tensor(state[key].astype(np.float32), device="cpu"))
    assert is_fp8_linear(m)
    np.testing.assert_array_equal(m.weight.view(flame.uint8).numpy(), q.view(flame.uint8).numpy())
    np.testing.assert_array_equal(m.weight_scale.numpy(), s.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [False, True])
def test_on_a_gpu_the_weights_are_read_quantised_and_kept_there(tmp_path, scaled):
    """device="cuda" (load_for_sampling's for generate --fp8 on a GPU): the block weights are read onto the GPU,
    quantised there by the kernel (the NumPy quantisation of a whole Flux would take minutes) and stay there; the
    rest of the model is read into host memory; the bytes are those of quantising after a plain load (a file's own
    fp8 bytes for a scaled file)."""
    path = _file(tmp_path, flux_params("flux-tiny"))
    if scaled:
        stored, _ = _scaled(_tensors(path))
        path = str(tmp_path / "scaled.safetensors")
        io.save_file(stored, path)
    after = load_flux(path, dtype=flame.bfloat16, device="cuda").requires_grad_(False)
    for s in STACKS:
        quantize_linear_weights_(after.get_submodule(s))
    with CIO.fp8_on_read(STACKS, device="cuda"):
        read = load_flux(path, dtype=flame.bfloat16, device="cpu")
    layers = _fp8_layers(read)
    assert len(layers) >= 14 and read.img_in.weight.device.type == "cpu"
    for n, m in layers.items():
        assert m.weight.device.type == "cuda" and m.weight_scale.device.type == "cuda", n
        if not scaled:
            want = _fp8_layers(after)[n]
            np.testing.assert_array_equal(m.weight.view(flame.uint8).cpu().numpy(),
                                          want.weight.view(flame.uint8).cpu().numpy(), err_msg=n)
            np.testing.assert_array_equal(m.weight_scale.cpu().numpy(), want.weight_scale.cpu().numpy(), err_msg=n)
    if scaled:
        key = "double_blocks.0.img_attn.proj.weight"
        np.testing.assert_array_equal(layers[key[:-len(".weight")]].weight.view(flame.uint8).cpu().numpy(),
                                      stored[key].view(np.uint8))


def test_saving_a_model_with_fp8_or_streamed_blocks_is_refused(tmp_path):
    """An fp8-stored Linear's scales are buffers no layout of the model holds: its file would have been the scaled
    bytes alone (Flux's qkv 447 off); streamed blocks' storage is the streamer's. Both refused, nothing written."""
    import os

    from flame_models.sd3 import load_sd3, save_sd3
    from flame_nn.offload import BlockStreamer
    path = _file(tmp_path, flux_params("flux-tiny"))
    with CIO.fp8_on_read(STACKS):
        model = load_flux(path, dtype=flame.float32, device="cpu")
    for layout in ("bfl", "diffusers"):
        out = tmp_path / f"out_{layout}.safetensors"
        with pytest.raises(ValueError, match=r"saving Flux: \d+ Linear layers store their weights in fp8"):
            save_flux(model, out, layout=layout)
        assert not out.exists()
    sai = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sd3", "dual",
                       "sai.safetensors")
    sd3 = load_sd3(sai, dtype=flame.float32, device="cpu").requires_grad_(False)
    quantize_linear_weights_(sd3.joint_blocks)
    with pytest.raises(ValueError, match=r"save_sd3: \d+ Linear layers store their weights in fp8"):
        save_sd3(sd3, tmp_path / "sd3.safetensors")
    streamed = load_flux(path, dtype=flame.float32, device="cpu").requires_grad_(False)
    streamed.streamer = BlockStreamer.for_model(streamed, list(STACKS), device="cpu")
    with pytest.raises(ValueError, match=r"saving Flux: the blocks are streamed from host memory"):
        save_flux(streamed, tmp_path / "streamed.safetensors")
    plain = load_flux(path, dtype=flame.float32, device="cpu")
    save_flux(plain, tmp_path / "plain.safetensors")           # (a plain model saves as before)
    assert (tmp_path / "plain.safetensors").exists()
