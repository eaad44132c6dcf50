"""flame_models.checkpoint_io, the checkpoint plumbing the model families share, and flame_nn's
GradientCheckpointingMixin: what the families' own loading tests do not pin down."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import save_file
from flame_models import checkpoint_io as CIO
from flame_models.flux import FluxCheckpointError
from flame_models.sd3 import SD3CheckpointError
from flame_models.sdxl import UNetCheckpointError
from flame_models.text_encoders import (
    CLIPTextConfig,
    CLIPTextModel,
    T5Config,
    T5EncoderModel,
    TextEncoderCheckpointError,
)
from flame_models.vae import VAECheckpointError


def test_family_errors_share_the_base_and_keep_their_builtin():
    for err, builtin in ((FluxCheckpointError, RuntimeError), (SD3CheckpointError, ValueError),
                         (UNetCheckpointError, RuntimeError), (VAECheckpointError, RuntimeError),
                         (TextEncoderCheckpointError, ValueError)):
        assert issubclass(err, CIO.CheckpointError) and issubclass(err, builtin) and issubclass(err, flame.FlameError)


def test_sharded_save_reads_back_through_the_index(tmp_path):
    items = [(f"w{i}", flame.tensor(np.full((4, 4), i, np.float32))) for i in range(5)]  # 64 bytes each
    written = CIO.save_weights(items, tmp_path / "model", stem="m", metadata={"k": "v"}, max_shard_size=130,
                               folder_config={"a": 1})
    names = [os.path.basename(p) for p in written]
    assert names == ["m-00001-of-00003.safetensors", "m-00002-of-00003.safetensors", "m-00003-of-00003.safetensors",
                     "m.safetensors.index.json"]
    index = json.loads((tmp_path / "model" / "m.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 64 and index["weight_map"]["w4"] == names[2]
    assert json.loads((tmp_path / "model" / "config.json").read_text()) == {"a": 1}
    files = CIO.safetensors_files(tmp_path / "model", what="test")
    assert files == written[:3]
    with CIO.SafetensorsCheckpoint(files) as ckpt:
        assert sorted(ckpt.keys()) == [k for k, _ in items] and ckpt.metadata("k") == "v"
        assert ckpt.shape("w3") == (4, 4) and ckpt.stored_dtype("w3") == flame.float32
        np.testing.assert_array_equal(ckpt.get("w3", dtype=flame.float16).float().numpy(), np.full((4, 4), 3.0))
    assert not [n for n in os.listdir(tmp_path / "model") if n.endswith(".tmp")]


def test_file_finding_errors_name_the_problem(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "one.safetensors")
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "two.safetensors")
    with pytest.raises(VAECheckpointError, match=r"found 2 safetensors files \(one.safetensors, two.safetensors\)"):
        CIO.folder_weights(tmp_path, VAECheckpointError)
    with pytest.raises(CIO.CheckpointError, match="appears in two files"):
        CIO.SafetensorsCheckpoint([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])
    (tmp_path / "x.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CIO.CheckpointError, match="missing: .*gone.safetensors"):
        CIO.index_files(str(tmp_path / "x.safetensors.index.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CIO.CheckpointError, match="bad.json: cannot read it as JSON"):
        CIO.index_files(str(tmp_path / "bad.json"))
    (tmp_path / "m.pt").write_bytes(b"x")
    with pytest.raises(UNetCheckpointError, match="m.pt: only safetensors"):
        CIO.safetensors_files(tmp_path / "m.pt", what="UNet", error=UNetCheckpointError)
    with pytest.raises(FileNotFoundError, match="no UNet checkpoint at"):
        CIO.safetensors_files(tmp_path / "absent.safetensors", what="UNet")


def test_mismatch_message_and_check():
    msg = CIO.mismatch_message("head:", [f"m{i}" for i in range(25)], ["u"], ["s: (1,) in the file, (2,) in the model"])
    assert msg.splitlines() == ["head:", "  missing keys (25): " + ", ".join(f"m{i}" for i in range(20))
                                + ", ... and 5 more", "  unexpected keys (1): u",
                                "  misshaped (1): s: (1,) in the file, (2,) in the model"]
    CIO.check_mismatch(VAECheckpointError, "head:", ["m"], ["u"], [], strict=False)  # tolerated
    with pytest.raises(VAECheckpointError, match=r"(?s)head:\n  missing \(1\): m\nhint"):
        CIO.check_mismatch(VAECheckpointError, "head:", ["m"], noun="", hint="hint")


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    path = tmp_path / "c.json"
    CIO.write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        CIO.write_json(path, {"v": object()})  # not JSON: fails half-way through the dump
    assert json.loads(path.read_text()) == {"v": 1} and os.listdir(tmp_path) == ["c.json"]


def test_config_argument():
    infer = lambda overrides: ("inferred", overrides)  # noqa: E731
    cfg = CLIPTextConfig()
    assert CIO.config_argument(cfg, CLIPTextConfig, infer, caller="f") is cfg
    assert CIO.config_argument({"a": 1}, CLIPTextConfig, infer, caller="f") == ("inferred", {"a": 1})
    with pytest.raises(TypeError, match="f: config must be a CLIPTextConfig, a dict of CLIPTextConfig fields or None, "
                                        "got str"):
        CIO.config_argument("clip-l", CLIPTextConfig, infer, caller="f")


@pytest.mark.parametrize("make", [
    lambda: CLIPTextModel(CLIPTextConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2)),
    lambda: T5EncoderModel(T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2))])
def test_gradient_checkpointing_switches(make):
    model = make()
    blocks = model.checkpointed_blocks()
    assert len(blocks) == 3 and not model.gradient_checkpointing
    assert model.enable_gradient_checkpointing(offload=True) is model
    assert model.gradient_checkpointing and all(b.gradient_checkpointing and b.checkpoint_offload for b in blocks)
    blocks[1].gradient_checkpointing = False
    assert not model.gradient_checkpointing  # on only when every block is
    model.gradient_checkpointing = True
    assert all(b.gradient_checkpointing for b in blocks)
    model.disable_gradient_checkpointing()
    assert not any(b.gradient_checkpointing or b.checkpoint_offload for b in blocks)
    assert model.dtype == flame.float32 and model.device == model.get_input_embeddings().weight.device


@pytest.mark.parametrize("keys, kind", [
    (["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"], "lora"),
    (["transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"], "lora"),
    (["model.diffusion_model.double_blocks.0.img_attn.qkv.weight"], "flux"),
    (["single_transformer_blocks.0.attn.to_q.weight"], "flux"),
    (["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "first_stage_model.decoder.conv_in.weight"],
     "sd3"),
    (["model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.decoder.conv_in.weight"], "unet"),
    (["time_embedding.linear_1.weight", "down_blocks.0.resnets.0.conv1.weight"], "unet"),
    (["encoder.down_blocks.0.resnets.0.conv1.weight", "encoder.mid_block.attentions.0.to_q.weight"], "vae"),
    (["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"], "text_encoders"),
    (["encoder.layers.0.self_attn.q_proj.weight"], "clip"),
    (["transformer.resblocks.0.attn.in_proj_weight"], "clip"),
    (["encoder.block.0.layer.0.SelfAttention.q.weight"], "t5"),
    (["weights.0"], "unknown")])
def test_one_description_of_what_a_file_holds(keys, kind):
    got, words, example = CIO.describe_keys(keys)
    assert got == kind and words and (example in keys)
    assert CIO.describe_keys([]) == ("unknown", "an unknown model", None)


def test_every_loader_describes_files_with_the_one_table(monkeypatch):
    # the model files check, the SDXL, VAE and SD3 loaders all read checkpoint_io.key_kinds: no table of their own
    from flame_models.checkpoint_io import reading
    from flame_models.sd3 import keys as sd3_keys
    from flame_models.sdxl import keys as sdxl_keys
    from flame_models.training import model_files
    from flame_models.vae import keys as vae_keys
    monkeypatch.setattr(reading, "key_kinds", lambda: (("odd", "an odd file", ("odd.",)),))
    keys = ["odd.weight"]
    assert model_files.describe_keys(keys) == ("odd", "an odd file", "odd.weight")
    assert sdxl_keys.describe(keys) == vae_keys.describe(keys) == "an odd file"
    assert sd3_keys.describe(keys).startswith("it looks like an odd file;")
