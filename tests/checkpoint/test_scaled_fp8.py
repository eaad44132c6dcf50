"""ComfyUI's scaled-fp8 checkpoints (flame_models/checkpoint_io/scaled_fp8.py) load for every family: each Linear
weight stored as float8 with its `scale_weight` (one value, or one per row) reads as `fp8 * scale`, the side keys
(`scale_input`, `comfy_quant`, the `scaled_fp8` marker) are understood, the family is still detected; a bad scale
or format is named before any weight is read. These files were refused for their unexpected scale keys."""
import json
import os

import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models import registry
from flame_models.checkpoint_io import CheckpointError, SafetensorsCheckpoint

F8 = ml_dtypes.float8_e4m3fn


def _tensors(path):
    with io.safe_open(path) as f:
        return {k: f.get_array(k) for k in f.keys()}


def _weights_file(path):
    """The one safetensors file of a checkpoint path (a file, or a folder holding one)."""
    if os.path.isfile(path):
        return path
    (name,) = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    return os.path.join(path, name)


def _scaled(state, *, row_scales=True, marker=True, formats=True):
    """(ComfyUI-style scaled fp8 state, the float32 state it stands for): every 2-D float weight quantised to
    float8_e4m3fn, alternately with one scale (amax / 448) and, with row_scales, one per row; every third layer with
    a `scale_input`, every fourth with a `comfy_quant` description."""
    out, want = {}, {}
    n = 0
    for k, v in state.items():
        a = np.asarray(v, np.float32) if v.dtype.kind == "f" or v.dtype == ml_dtypes.bfloat16 else v
        if not (k.endswith(".weight") and a.ndim == 2 and a.dtype == np.float32 and a.size):
            out[k], want[k] = v, v
            continue
        layer = k[:-len(".weight")]
        per_row = row_scales and n % 2 == 1
        amax = np.abs(a).max(axis=1) if per_row else np.abs(a).max()
        s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
        q = (a / (s[:, None] if per_row else s)).astype(F8)
        out[k] = q
        out[layer + (".weight_scale" if n % 5 == 4 else ".scale_weight")] = s if per_row else np.array(s, np.float32)
        want[k] = q.astype(np.float32) * (s[:, None] if per_row else s)
        if n % 3 == 0:
            out[layer + ".scale_input"] = np.array(1.0, np.float32)
        if formats and n % 4 == 0:
            fmt = "float8_e4m3fn_rowwise" if per_row else "float8_e4m3fn"
            out[layer + ".comfy_quant"] = np.frombuffer(json.dumps({"format": fmt}).encode(), np.uint8).copy()
        n += 1
    if marker:
        out["scaled_fp8"] = np.zeros(0, F8)
    assert n > 3                           # (layers were quantised: the test reads fp8 weights)
    return out, want


def _flux(d):
    from flame_models.flux import load_flux
    from flame_models.flux.tiny import tiny_flux_files
    files = tiny_flux_files(d / "flux")
    # ComfyUI's checkpoints: BFL names under model.diffusion_model.
    from flame_models.bfl.loading import save_flux
    bfl = str(d / "flux_bfl.safetensors")
    save_flux(load_flux(files.transformer, dtype=flame.float32, device="cpu"), bfl)
    state = {"model.diffusion_model." + k: v for k, v in _tensors(bfl).items()}
    return state, lambda p: load_flux(p, dtype=flame.float32, device="cpu")


def _flux_diffusers(d):
    from flame_models.flux import load_flux
    from flame_models.flux.tiny import tiny_flux_files
    files = tiny_flux_files(d / "flux")
    return _tensors(_weights_file(files.transformer)), lambda p: load_flux(p, dtype=flame.float32, device="cpu")


def _chroma(d):
    from flame_models.chroma import load_chroma
    from flame_models.chroma.tiny import tiny_chroma_files
    files = tiny_chroma_files(d / "chroma")
    return _tensors(_weights_file(files.transformer)), lambda p: load_chroma(p, dtype=flame.float32, device="cpu")


def _sd3(d):
    from flame_models.sd3 import load_sd3
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "fixtures", "sd3", "dual", "sai.safetensors")
    return _tensors(path), lambda p: load_sd3(p, dtype=flame.float32, device="cpu")


def _sdxl(d):
    from flame_models.sdxl import load_unet
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "fixtures", "sdxl", "tiny_sai.safetensors")
    return _tensors(path), lambda p: load_unet(p, dtype=flame.float32, device="cpu", progress=False)


def _qwen_image(d):
    from flame_models.qwen_image import load_qwen_image
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    folder = tiny_qwen_image_folder(d / "qwen")
    return (_tensors(_weights_file(os.path.join(folder, "transformer"))),
            lambda p: load_qwen_image(p, dtype=flame.float32, device="cpu"))


FAMILIES = {"flux": _flux, "flux-diffusers": _flux_diffusers, "chroma": _chroma, "sd3": _sd3, "sdxl": _sdxl,
            "qwen_image": _qwen_image}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_scaled_fp8_file_loads_as_its_dequantised_weights(family, tmp_path):
    state, load = FAMILIES[family](tmp_path)
    scaled, want = _scaled(state)
    path, ref = str(tmp_path / "model_fp8_scaled.safetensors"), str(tmp_path / "dequantised.safetensors")
    io.save_file(scaled, path)
    io.save_file(want, ref)
    got, expected = load(path).state_dict(), load(ref).state_dict()
    assert sorted(got) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(got[k].detach().numpy(), expected[k].detach().numpy(), err_msg=k)
    name, _ = registry.detect_family(path)   # (detection reads the header: the side keys do not hide the family)
    assert name == {"flux-diffusers": "flux"}.get(family, family)


def test_the_reader_takes_the_side_keys_out_and_dequantises(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (6, 5)).astype(np.float32)
    state, want = _scaled({"a.weight": w, "a.bias": np.ones(6, np.float32), "b.weight": 2 * w, "c.weight": w,
                           "d.weight": -w})
    path = str(tmp_path / "s.safetensors")
    io.save_file(state, path)
    with SafetensorsCheckpoint([path]) as ckpt:
        assert sorted(ckpt.keys()) == ["a.bias", "a.weight", "b.weight", "c.weight", "d.weight"]
        assert ckpt.dtype("a.weight") == F8                        # the stored dtype (the compute dtype follows)
        for k in ("a.weight", "b.weight", "c.weight", "d.weight"):
            np.testing.assert_array_equal(ckpt.get(k).numpy(), want[k])                        # float32
            np.testing.assert_array_equal(ckpt.get(k, dtype=flame.bfloat16).float().numpy(),
                                          want[k].astype(ml_dtypes.bfloat16).astype(np.float32))
            np.testing.assert_array_equal(ckpt.get_stored(k).float().numpy(), state[k].astype(np.float32))
            layer = k[:-len(".weight")]
            stored = state.get(layer + ".scale_weight", state.get(layer + ".weight_scale"))
            np.testing.assert_array_equal(ckpt.scale(k).numpy(), np.broadcast_to(stored, (6,)))
        assert ckpt.scale("a.bias") is None
        np.testing.assert_array_equal(ckpt.get("a.bias").numpy(), np.ones(6, np.float32))


def test_bad_scales_and_formats_are_named_before_any_weight_is_read(tmp_path):
    from flame_models.flux import FluxCheckpointError
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (8, 4)).astype(np.float32)
    base = {"x.weight": w.astype(F8), "x.scale_weight": np.float32([0.5])}

    def opened(state, cls=SafetensorsCheckpoint):
        path = str(tmp_path / "f.safetensors")
        io.save_file(state, path)
        return cls([path])

    with pytest.raises(CheckpointError, match=r"scale x.scale_weight has 3 values for a weight of 8 rows"):
        opened(dict(base, **{"x.scale_weight": np.ones(3, np.float32)}))
    nvfp4 = np.frombuffer(json.dumps({"format": "nvfp4"}).encode(), np.uint8).copy()
    with pytest.raises(CheckpointError, match=r"x.weight is quantised as 'nvfp4'"):
        opened(dict(base, **{"x.comfy_quant": nvfp4}))
    with pytest.raises(CheckpointError, match=r"x.comfy_quant is not a JSON description"):
        opened(dict(base, **{"x.comfy_quant": np.frombuffer(b"\xff\xfe", np.uint8).copy()}))
    with pytest.raises(CheckpointError, match=r"scale x.scale_weight is not finite float32 values: a damaged file"):
        opened(dict(base, **{"x.scale_weight": np.float32([np.nan])}))
    with pytest.raises(CheckpointError, match=r"scale x.scale_weight is not finite int32 values"):
        opened(dict(base, **{"x.scale_weight": np.int32([1])}))
    with pytest.raises(CheckpointError, match=r"x.weight has two scales, x.scale_weight and x.weight_scale"):
        opened(dict(base, **{"x.weight_scale": np.float32([0.5])}))
    # a family's own error class, naming the file
    from flame_models.bfl.checkpoint import BflCheckpoint

    class Flux(SafetensorsCheckpoint):
        error = FluxCheckpointError
    with pytest.raises(FluxCheckpointError, match=r"f.safetensors: scale x.scale_weight has 3 values"):
        opened(dict(base, **{"x.scale_weight": np.ones(3, np.float32)}), Flux)
    assert issubclass(BflCheckpoint, SafetensorsCheckpoint)
    # a scale without its weight stays in the index: the family names it as unexpected
    with opened({"y.weight": w, "z.scale_weight": np.float32([1.0])}) as ckpt:
        assert sorted(ckpt.keys()) == ["y.weight", "z.scale_weight"]


def test_an_orphan_scale_is_an_unexpected_key_of_the_family(tmp_path):
    from flame_models.flux import FluxCheckpointError, load_flux
    state, _ = _flux(tmp_path)
    state["model.diffusion_model.nowhere.scale_weight"] = np.float32([1.0])
    path = str(tmp_path / "orphan.safetensors")
    io.save_file(state, path)
    with pytest.raises(FluxCheckpointError, match=r"unexpected keys \(1\): model.diffusion_model.nowhere.scale_weight"):
        load_flux(path, device="cpu")


def test_float8_e5m2_weights_with_scales_are_widened_on_the_host(tmp_path):
    w = np.random.default_rng(2).normal(0, 1, (4, 3)).astype(np.float32)
    q = w.astype(ml_dtypes.float8_e5m2)
    path = str(tmp_path / "e5m2.safetensors")
    io.save_file({"x.weight": q, "x.scale_weight": np.float32([0.25]), "scaled_fp8": np.zeros(0, F8)}, path)
    with SafetensorsCheckpoint([path]) as ckpt:
        assert list(ckpt.keys()) == ["x.weight"]
        np.testing.assert_array_equal(ckpt.get("x.weight", device=flame.default_device()).cpu().numpy(),
                                      q.astype(np.float32) * np.float32(0.25))
