"""Loading and saving Flux checkpoints: BFL and diffusers layouts, prefixes, shards, dtype, errors."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core.io import safe_open, save_file
from flame_models.flux import Flux, FluxCheckpointError, flux_params, load_flux, save_flux
from flame_models.flux import keys as K
from flame_models.flux import loading as LD

TINY = flux_params("flux-tiny")


def random_tiny(seed=0, dtype=flame.float32, device=None):
    rng = np.random.default_rng(seed)
    with flame_nn.empty_init(dtype=dtype, device=device):
        model = Flux(TINY)
    model.load_state_dict({k: (0.1 * rng.standard_normal(s)).astype(np.float32)
                           for k, s in K.bfl_shapes(TINY).items()})
    return model


def inputs(device, dtype=flame.float32):
    rng = np.random.default_rng(3)
    img_ids = np.zeros((1, 4, 3), np.float32)
    img_ids[0, :, 1], img_ids[0, :, 2] = [0, 0, 1, 1], [0, 1, 0, 1]
    arrays = dict(img=rng.standard_normal((1, 4, 64)), img_ids=img_ids, txt=rng.standard_normal((1, 3, 32)),
                  txt_ids=np.zeros((1, 3, 3)), timesteps=np.array([0.5]), y=rng.standard_normal((1, 16)),
                  guidance=np.array([3.5]))
    return {k: flame.tensor(v, dtype=dtype, device=device) for k, v in arrays.items()}


def assert_same_weights(a, b):
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        np.testing.assert_array_equal(sa[k].detach().numpy(), sb[k].detach().numpy(), err_msg=k)


def file_tensors(path):
    with safe_open(path) as f:
        return {k: f.get_array(k) for k in f.keys()}


def test_bfl_file_roundtrip_and_prefix(tmp_path, device):
    model = random_tiny(device=device)
    path = tmp_path / "flux.safetensors"
    assert save_flux(model, path) == [str(path)]
    stored = file_tensors(path)
    assert list(stored) == list(K.bfl_shapes(TINY))
    loaded = load_flux(path, device=device)
    assert_same_weights(model, loaded)
    # ComfyUI repack: prefixed keys beside other models' tensors, no FLAME metadata
    comfy = {"model.diffusion_model." + k: v for k, v in stored.items()}
    comfy["first_stage_model.decoder.conv_in.weight"] = np.ones((2, 2), np.float32)
    save_file(comfy, tmp_path / "comfy.safetensors")
    assert_same_weights(model, load_flux(tmp_path / "comfy.safetensors", device=device))


def test_diffusers_file_and_sharded_folder_load_to_the_same_model(tmp_path, device):
    model = random_tiny(device=device)
    one = tmp_path / "diffusers.safetensors"
    save_flux(model, one, layout="diffusers")
    names = set(file_tensors(one))
    assert "transformer_blocks.1.attn.add_k_proj.weight" in names and "norm_out.linear.bias" in names
    assert not any(n.startswith(("double_blocks", "single_blocks")) for n in names)
    assert_same_weights(model, load_flux(one, device=device))

    folder = tmp_path / "transformer"
    files = save_flux(model, folder, layout="diffusers", max_shard_size=60_000)
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    assert str(index) in files and len(files) > 3
    weight_map = json.loads(index.read_text())["weight_map"]
    assert set(weight_map) == names and len(set(weight_map.values())) == len(files) - 1
    config = json.loads((folder / "config.json").read_text())
    assert config["num_layers"] == 2 and config["axes_dims_rope"] == [8, 12, 12] and config["guidance_embeds"]
    for path in (folder, index, tmp_path):  # the folder, its index, and a pipeline folder holding transformer/
        assert_same_weights(model, load_flux(path, device=device))


def test_layout_conversion_roundtrip_gives_identical_outputs(tmp_path, device):
    model = random_tiny(device=device)
    save_flux(model, tmp_path / "d.safetensors", layout="diffusers")
    from_diffusers = load_flux(tmp_path / "d.safetensors", device=device)
    save_flux(from_diffusers, tmp_path / "b.safetensors", layout="bfl")
    save_flux(model, tmp_path / "a.safetensors", layout="bfl")
    a, b = file_tensors(tmp_path / "a.safetensors"), file_tensors(tmp_path / "b.safetensors")
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    args = inputs(device)
    with flame.no_grad():
        out_a, out_b = model(**args).numpy(), from_diffusers(**args).numpy()
    assert np.abs(out_a).max() > 1e-3
    np.testing.assert_array_equal(out_a, out_b)


def test_diffusers_checkpoint_without_metadata_infers_the_config(tmp_path):
    model = random_tiny()
    state = {k: t.detach() for k, t in model.named_parameters()}
    save_file(K.bfl_to_diffusers(state, TINY), tmp_path / "plain.safetensors")  # as diffusers writes it
    with LD._Checkpoint(tmp_path / "plain.safetensors") as ckpt:
        assert ckpt.layout == "diffusers" and ckpt.metadata_params() is None
        assert LD.infer_params(ckpt) == TINY
    schnell_like = {k: v for k, v in state.items() if not k.startswith("guidance_in")}
    save_file(schnell_like, tmp_path / "schnell.safetensors")
    with LD._Checkpoint(tmp_path / "schnell.safetensors") as ckpt:
        assert LD.infer_params(ckpt) == TINY.replace(guidance_embed=False)


def test_load_converts_dtype_and_does_not_initialise_randomly(tmp_path, device, monkeypatch):
    model = random_tiny(device=device)
    path = tmp_path / "flux.safetensors"
    save_flux(model, path)

    def only_meta(fn):  # layers may call init on their placeholders (a no-op), never on real storage
        def guarded(t, *args, **kwargs):
            if not t.is_meta:
                raise AssertionError(f"random initialisation of a {tuple(t.shape)} tensor while loading")
            return fn(t, *args, **kwargs)
        return guarded
    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        monkeypatch.setattr(flame_nn.init, name, only_meta(getattr(flame_nn.init, name)))
    loaded = load_flux(path, dtype=flame.bfloat16, device=device)
    for k, p in loaded.named_parameters():
        assert p.dtype == flame.bfloat16 and not p.is_meta and p.device == flame.device(device), k
    w = dict(model.named_parameters())["single_blocks.1.linear1.weight"].detach().numpy()
    got = dict(loaded.named_parameters())["single_blocks.1.linear1.weight"].float().detach().numpy()
    np.testing.assert_array_equal(got, w.astype(flame.bfloat16.np).astype(np.float32))


def test_errors_name_missing_unexpected_and_misshaped_keys(tmp_path):
    stored = file_tensors(save_flux(random_tiny(), tmp_path / "ok.safetensors")[0])
    broken = dict(stored)
    del broken["double_blocks.1.txt_mlp.2.bias"]
    broken["double_blocks.0.img_attn.extra.weight"] = np.zeros(3, np.float32)
    save_file(broken, tmp_path / "broken.safetensors")
    with pytest.raises(FluxCheckpointError, match=r"missing keys \(1\): double_blocks.1.txt_mlp.2.bias") as e:
        load_flux(tmp_path / "broken.safetensors", params=TINY)
    assert "unexpected keys (1): double_blocks.0.img_attn.extra.weight" in str(e.value)

    d = K.bfl_to_diffusers({k: flame.tensor(v) for k, v in stored.items()}, TINY)
    d["transformer_blocks.0.attn.to_k.weight"] = flame.zeros(8, 64)
    save_file(d, tmp_path / "misshaped.safetensors")
    with pytest.raises(FluxCheckpointError, match=r"transformer_blocks.0.attn.to_q.weight\+transformer_blocks.0"
                                                  r".attn.to_k.weight\+transformer_blocks.0.attn.to_v.weight"):
        load_flux(tmp_path / "misshaped.safetensors", params=TINY)
    with pytest.raises(FileNotFoundError):
        load_flux(tmp_path / "absent.safetensors")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FluxCheckpointError, match="found 0 safetensors"):
        load_flux(tmp_path / "empty")


def test_a_file_without_a_flux_transformer_raises_the_flux_error_naming_it(tmp_path):
    """load_flux / read_flux_params on a file of other tensors: FluxCheckpointError naming the file and the probes
    (not a bare KeyError that the callers' `except FluxCheckpointError` lets through)."""
    path = str(tmp_path / "other.safetensors")
    save_file({"decoder.conv_in.weight": flame.zeros(4, 16, 3, 3)}, path)
    for call in (load_flux, LD.read_flux_params):
        with pytest.raises(FluxCheckpointError, match=f"{path}: not a Flux transformer checkpoint"):
            call(path)
