"""Loading and saving SD3 transformers: SAI single files (prefix, extra VAE / text-encoder tensors) and diffusers
folders (sharded, index, config.json), the config from the shapes, round trips both ways, dtype, errors."""
import json
import shutil

import numpy as np
import pytest
from sd3_helpers import FIXTURES, diffusers_dir, inputs, io, npy, params, sai_file

import flame_core as flame
from flame_core.io import safe_open, save_file
from flame_models.sd3 import MMDiT, SD3CheckpointError, load_sd3, save_sd3
from flame_models.sd3 import keys as K
from flame_models.sd3.loading import diffusers_config


def file_tensors(path):
    with safe_open(path) as f:
        return {k: f.get_array(k) for k in f.keys()}


def folder_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(file_tensors(f))
    return out


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        np.testing.assert_array_equal(npy(sa[k]), npy(sb[k]), err_msg=k)


@pytest.mark.parametrize("variant", ["plain", "dual"])
def test_config_is_inferred_from_a_diffusers_folder(variant, device):
    model = load_sd3(diffusers_dir(variant), device=device)
    assert model.params == params(variant)
    assert all(p.dtype == flame.float32 and not p.is_meta for p in model.parameters())  # the file's dtype
    if variant == "dual":  # a sharded folder: three files and the index
        assert len(list(diffusers_dir(variant).glob("*.safetensors"))) == 3


def test_sai_file_with_vae_and_text_encoders_loads_the_transformer_only(device):
    model = load_sd3(sai_file("dual"), device=device)
    assert model.params == params("dual").replace(sample_size=128)  # sample_size is not stored in SAI files
    ref = load_sd3(diffusers_dir("dual"), device=device)
    sa, sr = model.state_dict(), ref.state_dict()
    for k in sa:
        np.testing.assert_array_equal(npy(sa[k]), npy(sr[k]), err_msg=k)


def test_sai_file_without_qk_norm_needs_the_head_dim():
    with pytest.raises(SD3CheckpointError, match="not a multiple of 64.*params="):
        load_sd3(sai_file("plain"))
    assert load_sd3(sai_file("plain"), params=params("plain")).params == params("plain")


def test_pipeline_folder_and_index_json(tmp_path, device):
    pipe = tmp_path / "sd3-pipeline"
    shutil.copytree(diffusers_dir("dual"), pipe / "transformer")
    (pipe / "model_index.json").write_text("{}")
    a = load_sd3(pipe, device=device)
    b = load_sd3(pipe / "transformer" / "diffusion_pytorch_model.safetensors.index.json", device=device)
    assert a.params == b.params == params("dual")
    assert_same_weights(a, b)
    (pipe / "transformer" / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(SD3CheckpointError, match="missing.*00002-of-00003"):
        load_sd3(pipe)


def test_saved_layouts_equal_the_reference_files(tmp_path, device):
    """Saving a model loaded from one layout writes exactly the other layout's reference tensors."""
    model = load_sd3(diffusers_dir("dual"), device=device)
    sai = save_sd3(model, tmp_path / "sd3.safetensors")
    assert sai == [str(tmp_path / "sd3.safetensors")]
    ref = {k: v for k, v in file_tensors(sai_file("dual")).items() if k.startswith("model.diffusion_model.")}
    got = file_tensors(sai[0])
    assert list(got) == ["model.diffusion_model." + k for k in K.sai_shapes(model.params)]
    assert set(got) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)

    from_sai = load_sd3(sai_file("dual"), device=device)
    out = tmp_path / "diffusers"
    files = save_sd3(from_sai, out, layout="diffusers")
    assert [f.split("/")[-1] for f in files] == ["diffusion_pytorch_model.safetensors"]
    ref = folder_tensors(diffusers_dir("dual"))
    got = folder_tensors(out)
    assert set(got) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    config = json.loads((out / "config.json").read_text())
    theirs = json.loads((diffusers_dir("dual") / "config.json").read_text())
    assert config["_class_name"] == theirs["_class_name"] == "SD3Transformer2DModel"
    assert {k: v for k, v in config.items() if not k.startswith("_")} == \
        {k: theirs[k] for k in config if not k.startswith("_") and k != "sample_size"} | {"sample_size": 128}
    assert not list(tmp_path.rglob("*.tmp"))


def test_round_trips_sharded_prefixed_and_bare(tmp_path, device):
    model = load_sd3(diffusers_dir("plain"), device=device)
    # sharded diffusers folder with an index, reloaded with its FLAME metadata (head dim 8 needs no params=)
    files = save_sd3(model, tmp_path / "d", layout="diffusers", max_shard_size=30_000)
    assert files[-1].endswith("diffusion_pytorch_model.safetensors.index.json") and len(files) > 3
    assert_same_weights(model, load_sd3(tmp_path / "d", device=device))
    # SAI, prefixed (default) and bare
    for prefix, name in ((None, "pre.safetensors"), ("", "bare.safetensors")):
        path = save_sd3(model, tmp_path / name, prefix=prefix)[0]
        keys = list(file_tensors(path))
        assert all(k.startswith("model.diffusion_model.") for k in keys) == (prefix is None)
        back = load_sd3(path, device=device)
        assert back.params == model.params
        assert_same_weights(model, back)
    # dtype on load, from a float32 file
    half = load_sd3(tmp_path / "bare.safetensors", dtype=flame.bfloat16, device=device)
    assert all(t.dtype == flame.bfloat16 for t in half.state_dict().values())


def test_loaded_model_runs_the_reference_forward_after_a_round_trip(tmp_path, device):
    arrays = io("dual")
    model = load_sd3(sai_file("dual"), dtype=flame.float64, device=device)
    path = save_sd3(model, tmp_path / "x", layout="diffusers")[0]
    back = load_sd3(path, device=device)
    assert back.x_embedder.proj.weight.dtype == flame.float64
    with flame.no_grad():
        out = npy(back(*inputs(arrays, flame.float64, device)))
    np.testing.assert_allclose(out, arrays["out_f64"], rtol=1e-9, atol=1e-11)


# ----------------------------------------------------------------------------- errors
def test_a_file_that_is_not_an_sd3_transformer_says_what_it_looks_like(tmp_path):
    cases = {
        "flux.safetensors": {"double_blocks.0.img_attn.qkv.weight": np.zeros((6, 2), np.float32)},
        "vae.safetensors": {"decoder.conv_in.weight": np.zeros((2, 2), np.float32)},
        "lora.safetensors": {"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": np.zeros((2, 2),
                                                                                                   np.float32)},
        "text.safetensors": {"text_encoders.clip_l.transformer.text_model.x": np.zeros(2, np.float32)},
    }
    expect = {"flux": "Flux transformer", "vae": "a VAE", "lora": "LoRA", "text": "text encoders"}
    for name, tensors in cases.items():
        save_file(tensors, tmp_path / name)
        with pytest.raises(SD3CheckpointError) as e:
            load_sd3(tmp_path / name)
        msg = str(e.value)
        assert "\n" not in msg and "not an SD3 transformer" in msg and expect[name.split(".")[0]] in msg, msg
    with pytest.raises(FileNotFoundError):
        load_sd3(tmp_path / "nothing.safetensors")


def test_missing_unexpected_and_misshaped_keys_are_named(tmp_path):
    stored = file_tensors(sai_file("dual"))
    pre = "model.diffusion_model."
    broken = dict(stored)
    del broken[pre + "joint_blocks.1.x_block.mlp.fc2.bias"]
    broken[pre + "joint_blocks.1.x_block.attn2.qkv.weight"] = np.zeros((48, 16), np.float32)
    broken[pre + "context_embedder.weight"] = np.zeros((16, 25), np.float32)
    save_file(broken, tmp_path / "broken.safetensors")
    with pytest.raises(SD3CheckpointError) as e:
        load_sd3(tmp_path / "broken.safetensors", params=params("dual"))
    msg = str(e.value)
    assert "joint_blocks.1.x_block.mlp.fc2.bias" in msg and "missing" in msg
    assert "unexpected" in msg and "joint_blocks.1.x_block.attn2.qkv.weight" in msg
    assert "misshaped" in msg and "context_embedder.weight: (16, 25) in the file, (16, 24) in the model" in msg
    # not strict: missing and unexpected keys are tolerated, a wrong shape never is
    del broken[pre + "context_embedder.weight"]
    broken[pre + "context_embedder.weight"] = stored[pre + "context_embedder.weight"]
    save_file(broken, tmp_path / "partial.safetensors")
    with pytest.raises(SD3CheckpointError):
        load_sd3(tmp_path / "partial.safetensors", params=params("dual"))
    model = load_sd3(tmp_path / "partial.safetensors", params=params("dual"), strict=False)
    assert model.joint_blocks[1].x_block.mlp.fc2.bias.is_meta


def test_save_rejects_unknown_layouts(tmp_path):
    model = MMDiT("sd3.5-tiny", dtype=flame.float32)
    with pytest.raises(ValueError, match="layout"):
        save_sd3(model, tmp_path / "a.safetensors", layout="comfy")
    with pytest.raises(ValueError, match="prefix"):
        save_sd3(model, tmp_path / "a", layout="diffusers", prefix="x.")
    assert not list(tmp_path.iterdir())


def test_diffusers_config_of_the_released_models():
    from flame_models.sd3 import sd3_params
    c = diffusers_config(sd3_params("sd3.5-medium"))
    assert c["num_layers"] == 24 and c["attention_head_dim"] == 64 and c["num_attention_heads"] == 24
    assert c["dual_attention_layers"] == list(range(13)) and c["qk_norm"] == "rms_norm"
    assert c["pos_embed_max_size"] == 384 and c["caption_projection_dim"] == 1536
    assert FIXTURES.is_dir()
