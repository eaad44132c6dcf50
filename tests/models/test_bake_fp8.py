"""python -m flame_models.bake --fp8: the blocks' Linear weights written as ComfyUI's scaled fp8
(checkpoint_io/scaled_fp8.py: float8_e4m3fn, a float32 scale_weight per weight, the scaled_fp8 marker under the
model's prefix) -- quantised from the merged LoRA value, or converted alone --, every other tensor copied bit for bit;
FLAME reads the file back (dequantised, and its bytes kept under fp8 storage); the refusals."""
import os

import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
import flame_nn
from flame_core import io
from flame_models import checkpoint_io as CIO
from flame_models.bake import BakeError, bake, main
from flame_models.checkpoint_io.scaled_fp8 import quantize
from flame_models.flux import Flux, flux_params, load_flux, save_flux
from flame_models.flux import keys as K
from flame_nn import adapters as A
from flame_nn.offload import is_fp8_linear
from flame_nn.offload.fp8 import release_scratch

STACKS = ("double_blocks", "single_blocks")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.fixture(autouse=True)
def _fresh_scratch():
    yield
    release_scratch()


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux in both layouts (float32, random weights) and a kohya LoRA on its blocks."""
    d = tmp_path_factory.mktemp("bake_fp8")
    p = flux_params("flux-tiny")
    rng = np.random.default_rng(0)
    with flame_nn.empty_init(dtype=flame.float32, device="cpu"):
        model = Flux(p)
    model.load_state_dict({k: (0.05 * rng.standard_normal(s)).astype(np.float32) for k, s in K.bfl_shapes(p).items()})
    files = {}
    for layout in ("bfl", "diffusers"):
        files[layout] = str(d / f"flux_{layout}.safetensors")
        save_flux(model, files[layout], layout=layout)
    A.inject_adapters(model, ["double_blocks.*", "single_blocks.*"], rank=2, alpha=1.0)
    with flame.no_grad():
        for _, q in A.named_adapter_parameters(model):
            q.copy_(flame.tensor(rng.normal(0, 0.2, tuple(q.shape)).astype(np.float32), device="cpu"))
    files["lora"] = A.save_adapters(model, str(d / "lora.safetensors"), format="kohya")
    return files


def _read(path):
    with io.safe_open(path) as f:
        return {k: f.get_array(k) for k in f.keys()}, dict(f.metadata() or {})


def _quantised(tensors):
    return sorted(k for k, v in tensors.items() if v.dtype == E4M3 and not k.endswith("scaled_fp8"))


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_conversion_alone(flux, tmp_path, layout):
    """No LoRA: each block Linear weight is quantize(its value) with its scale after it; every other tensor (the
    embedders, norms, biases, final layer) copied bit for bit; FLAME reads the file back as stored · scale."""
    base, out = flux[layout], str(tmp_path / "fp8.safetensors")
    changed = bake(base, [], out, fp8=True)
    before, _ = _read(base)
    got, meta = _read(out)
    q_keys = _quantised(got)
    assert q_keys == changed and len(q_keys) >= 14
    # the marker: two values (ComfyUI's full-precision matmul over the dequantised weights)
    assert got["scaled_fp8"].dtype == E4M3 and got["scaled_fp8"].shape == (2,)
    assert sorted(got) == sorted(set(before) | {"scaled_fp8"} | {k[:-7] + ".scale_weight" for k in q_keys})
    for k in before:
        if k in q_keys:
            q, s = quantize(before[k])
            np.testing.assert_array_equal(got[k].view(np.uint8), q.view(np.uint8), err_msg=k)
            scale = got[k[:-7] + ".scale_weight"]
            assert scale.dtype == np.float32 and scale.shape == () and scale == s
            err = np.abs(got[k].astype(np.float32) * scale - before[k])
            assert (err <= np.abs(before[k]) / 16 + scale * 2.0 ** -10).all(), k   # e4m3: 3 mantissa bits
        else:
            np.testing.assert_array_equal(got[k], before[k], err_msg=k)
            assert not k.startswith(("double_blocks", "single_blocks", "transformer_blocks",
                                     "single_transformer_blocks")) or k.endswith(".bias") or before[k].ndim == 1
    assert '"scaled_fp8"' in meta["flame.fp8"] and "flame.baked" not in meta
    # FLAME's reader: the dequantised weights (stored · scale in float32), the rest as it was
    want = load_flux(base, dtype=flame.float32, device="cpu").state_dict()
    read = load_flux(out, dtype=flame.float32, device="cpu").state_dict()
    assert sorted(read) == sorted(want)
    for k, v in want.items():
        a, b = read[k].numpy(), v.numpy()
        np.testing.assert_allclose(a, b, rtol=1 / 16, atol=1e-4, err_msg=k)
    # fp8 storage keeps the file's bytes and scales (nothing re-rounded)
    with CIO.fp8_on_read(STACKS):
        model = load_flux(out, dtype=flame.float32, device="cpu")
    layer = model.get_submodule("single_blocks.0.linear2")
    assert is_fp8_linear(layer)
    key = "single_blocks.0.linear2.weight" if layout == "bfl" else "single_transformer_blocks.0.proj_out.weight"
    np.testing.assert_array_equal(layer.weight.view(flame.uint8).numpy(), got[key].view(np.uint8))
    np.testing.assert_array_equal(layer.weight_scale.numpy(),
                                  np.full(got[key].shape[0], got[key[:-7] + ".scale_weight"], np.float32))


def test_a_lora_baked_then_quantised(flux, tmp_path):
    """With a LoRA: the merged weight quantised (within an e4m3 rounding of the plain bake's), the scale after it,
    the LoRA recorded; the command writes the same file."""
    plain, fp8 = str(tmp_path / "plain.safetensors"), str(tmp_path / "fp8.safetensors")
    bake(flux["bfl"], [f"{flux['lora']}:0.8"], plain)
    changed = bake(flux["bfl"], [f"{flux['lora']}:0.8"], fp8, fp8=True)
    a, _ = _read(plain)
    b, meta = _read(fp8)
    before, _ = _read(flux["bfl"])
    assert _quantised(b) == changed
    moved = 0
    for k in changed:
        scale = b[k[:-7] + ".scale_weight"]
        err = np.abs(b[k].astype(np.float32) * scale - a[k])
        assert (err <= np.abs(a[k]) / 16 + scale * 2.0 ** -9).all(), k
        moved += not np.array_equal(a[k], before[k])
    assert moved >= 10 and "lora.safetensors" in meta["flame.baked"]
    cli = str(tmp_path / "cli.safetensors")
    assert main(["--model", flux["bfl"], "--lora", f"{flux['lora']}:0.8", "--fp8", "--output", cli]) == 0
    c, _ = _read(cli)
    assert sorted(c) == sorted(b) and all(c[k].tobytes() == b[k].tobytes() for k in b)


@pytest.mark.parametrize("family", ["sd3", "sdxl"])
def test_sd3_and_sdxl_files(tmp_path, family):
    """An SD3 MMDiT (diffusers layout) and an SAI SDXL file holding the VAE and text encoders: only the denoiser's
    block Linears are quantised (SDXL: under model.diffusion_model., the marker there too: where ComfyUI looks for
    it); FLAME reads the files back."""
    here = os.path.join(os.path.dirname(__file__), "..", "fixtures")
    if family == "sd3":
        from flame_models.sd3 import load_sd3 as load
        base = os.path.join(here, "sd3", "plain", "transformer", "diffusion_pytorch_model.safetensors")
        prefix, blocks = "", ("transformer_blocks.",)
    else:
        from flame_models.sdxl import load_unet as load
        base = os.path.join(here, "sdxl", "tiny_sai.safetensors")
        prefix = "model.diffusion_model."
        blocks = tuple(prefix + s + "." for s in ("input_blocks", "middle_block", "output_blocks"))
    out = str(tmp_path / "fp8.safetensors")
    changed = bake(base, [], out, fp8=True)
    got, _ = _read(out)
    before, _ = _read(base)
    assert changed and all(k.startswith(blocks) for k in changed)
    assert got[prefix + "scaled_fp8"].dtype == E4M3
    for k in before:
        if k not in changed:
            np.testing.assert_array_equal(got[k], before[k], err_msg=k)   # (SDXL: the VAE, CLIPs, convolutions)
    kw = {} if family == "sd3" else {"progress": False}
    want = load(base, dtype=flame.float32, device="cpu", **kw)
    read = load(out, dtype=flame.float32, device="cpu", params=want.params, **kw) if family == "sd3" else \
        load(out, dtype=flame.float32, device="cpu", **kw)
    w, r = want.state_dict(), read.state_dict()
    assert sorted(w) == sorted(r)
    for k in w:
        np.testing.assert_allclose(r[k].numpy(), w[k].numpy(), rtol=1 / 16, atol=1e-3, err_msg=k)


def test_what_fp8_refuses(flux, tmp_path, capsys):
    out = str(tmp_path / "fp8.safetensors")
    bake(flux["bfl"], [], out, fp8=True)
    with pytest.raises(BakeError, match="already holds float8 tensors"):
        bake(out, [], str(tmp_path / "again.safetensors"), fp8=True)
    with pytest.raises(BakeError, match="no LoRA to bake: pass --lora .*, or --fp8"):
        bake(flux["bfl"], [], str(tmp_path / "none.safetensors"))
    other = str(tmp_path / "other.safetensors")
    io.save_file({"layers.0.weight": np.ones((4, 4), np.float32)}, other)
    with pytest.raises(BakeError, match="--fp8: writes Flux, Flux Kontext, Chroma, SD3 and SDXL checkpoints"):
        bake(other, [], str(tmp_path / "o.safetensors"), fp8=True)
    bad = str(tmp_path / "nan.safetensors")
    t, _ = _read(flux["bfl"])
    t["double_blocks.0.img_attn.qkv.weight"][0, 0] = np.nan
    io.save_file(t, bad)
    dst = tmp_path / "never.safetensors"
    with pytest.raises(BakeError, match="double_blocks.0.img_attn.qkv.weight: not all finite"):
        bake(bad, [], str(dst), fp8=True)
    assert not dst.exists() and not [f for f in os.listdir(tmp_path) if f.startswith("never")]   # nothing half-written
    assert main(["--model", other, "--fp8", "--output", str(tmp_path / "x.safetensors")]) == 2
    assert "--fp8: writes" in capsys.readouterr().err
