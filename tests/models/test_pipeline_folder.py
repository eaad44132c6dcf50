"""checkpoint_io.write_pipeline_folder (a full fine-tune's save.save_format: diffusers): the denoiser's subfolder and
the base pipeline's listed components (hard links, through the symlinks of a Hugging Face cache snapshot too), only
what model_index.json lists; a folder written again is replaced whole; a failed write leaves the old folder and no
partial one."""
import json
import os

import pytest

from flame_models.checkpoint_io import pipeline_components, write_pipeline_folder


def _base(tmp_path):
    """A pipeline folder as a Hugging Face cache snapshot holds it: its files are symlinks to blobs."""
    blobs, base = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    files = {"vae/config.json": "{}", "vae/diffusion_pytorch_model.safetensors": "V" * 64,
             "text_encoder/model.safetensors": "T" * 64, "transformer/old.safetensors": "OLD",
             "scheduler/scheduler_config.json": "{}", "flux1-dev.safetensors": "SINGLE FILE"}
    for i, (rel, text) in enumerate(files.items()):
        blob = blobs / f"blob{i}"
        blob.write_text(text)
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (base / rel).parent), base / rel)   # relative, as the hub's
    index = {"_class_name": "FluxPipeline", "_diffusers_version": "0.30.0", "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModel"], "transformer": ["diffusers", "FluxTransformer2DModel"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "tokenizer": [None, None],
             "text_encoder_2": ["transformers", "T5EncoderModel"]}   # (listed, absent: skipped)
    (base / "model_index.json").write_text(json.dumps(index))
    return str(base), blobs


def _denoiser(text):
    def write(folder):
        os.makedirs(folder)
        with open(os.path.join(folder, "diffusion_pytorch_model.safetensors"), "w") as f:
            f.write(text)
    return write


def test_the_listed_components_are_linked_beside_the_new_denoiser(tmp_path):
    base, blobs = _base(tmp_path)
    assert pipeline_components(base) == ["scheduler", "text_encoder", "transformer", "vae"]
    out = str(tmp_path / "run" / "model")
    assert write_pipeline_folder(out, "transformer", _denoiser("NEW"), base=base) == [out]
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "text_encoder", "transformer", "vae"]
    assert os.listdir(os.path.join(out, "transformer")) == ["diffusion_pytorch_model.safetensors"]   # not the old
    vae = os.path.join(out, "vae", "diffusion_pytorch_model.safetensors")
    assert not os.path.islink(vae) and os.path.samefile(vae, blobs / "blob1")   # a hard link to the blob itself
    with open(os.path.join(out, "model_index.json")) as f:
        assert json.load(f)["_class_name"] == "FluxPipeline"
    assert sorted(os.listdir(tmp_path / "run")) == ["model"]                    # no partial or old folder left


def test_without_a_pipeline_base_the_denoiser_alone(tmp_path):
    single = tmp_path / "flux1-dev.safetensors"
    single.write_text("x")
    for base in (None, str(single), str(tmp_path / "missing")):
        out = str(tmp_path / f"out{hash(base) & 0xffff}")
        write_pipeline_folder(out, "unet", _denoiser("NEW"), base=base)
        assert os.listdir(out) == ["unet"]


def test_written_again_replaces_the_folder_and_a_failure_keeps_the_old(tmp_path):
    base, _ = _base(tmp_path)
    out = str(tmp_path / "model")
    write_pipeline_folder(out, "transformer", _denoiser("FIRST"), base=base)
    write_pipeline_folder(out, "transformer", _denoiser("SECOND"), base=base)
    weights = os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors")
    with open(weights) as f:
        assert f.read() == "SECOND"

    def broken(folder):
        _denoiser("THIRD")(folder)
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_pipeline_folder(out, "transformer", broken, base=base)
    with open(weights) as f:
        assert f.read() == "SECOND"
    assert sorted(os.listdir(tmp_path)) == ["blobs", "model", "snapshot"]
    os.makedirs(tmp_path / "model.old-99999" / "transformer")     # a process killed between its two renames
    os.makedirs(tmp_path / "model.partial-99998")
    write_pipeline_folder(out, "transformer", _denoiser("FOURTH"), base=base)
    assert sorted(os.listdir(tmp_path)) == ["blobs", "model", "snapshot"]   # the stale ones cleared
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        write_pipeline_folder(str(tmp_path / "file"), "transformer", _denoiser("x"))
