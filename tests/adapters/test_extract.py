"""Extracting a LoRA from two checkpoints (flame_nn/adapters/extract.py, kohya's extract_lora_from_models): a known
low-rank difference recovered (Linear and Conv2d, kohya and PEFT names), the randomized SVD against the exact one,
the tiny Flux's fine-tune turned back into a LoRA that FLAME's generate applies, what is left out, and the
refusals."""
import os
import shutil

import numpy as np
import pytest
from lora_files import read as _read
from lora_files import write as _write

from flame_core import io
from flame_nn.adapters.extract import extract_files, low_rank_svd, main
from flame_nn.adapters.resize import ResizeError


def _low_rank(rng, out, inn, r, scale=1.0):
    return scale * (rng.standard_normal((out, r)) @ rng.standard_normal((r, inn)))


@pytest.fixture
def models(tmp_path):
    rng = np.random.default_rng(0)
    base = {"double_blocks.0.img_attn.qkv.weight": rng.standard_normal((48, 16)),
            "double_blocks.0.img_attn.qkv.bias": rng.standard_normal(48),
            "double_blocks.0.img_mlp.0.weight": rng.standard_normal((64, 16)),
            "conv_in.weight": rng.standard_normal((8, 4, 3, 3)),
            "final_layer.linear.weight": rng.standard_normal((16, 16))}
    tuned = dict(base)
    tuned["double_blocks.0.img_attn.qkv.weight"] = base["double_blocks.0.img_attn.qkv.weight"] + _low_rank(
        rng, 48, 16, 3, 0.1)
    tuned["double_blocks.0.img_mlp.0.weight"] = base["double_blocks.0.img_mlp.0.weight"] + _low_rank(rng, 64, 16, 2)
    tuned["conv_in.weight"] = base["conv_in.weight"] + _low_rank(rng, 8, 36, 2).reshape(8, 4, 3, 3)
    tuned["double_blocks.0.img_attn.qkv.bias"] = base["double_blocks.0.img_attn.qkv.bias"] + 1.0
    base32 = {k: v.astype(np.float32) for k, v in base.items()}
    tuned32 = {k: v.astype(np.float32) for k, v in tuned.items()}
    tuned32["only_tuned.weight"] = np.ones((2, 2), np.float32)
    return _write(tmp_path / "base.safetensors", base32), _write(tmp_path / "tuned.safetensors", tuned32), base32, \
        tuned32


def test_a_low_rank_difference_comes_back(models, tmp_path):
    base, tuned, b, t = models
    report, skipped = extract_files(base, tuned, str(tmp_path / "lora.safetensors"), 4)
    out, meta = _read(tmp_path / "lora.safetensors")
    assert {n: k for n, k, _ in report} == {"lora_unet_double_blocks_0_img_attn_qkv": 4,
                                            "lora_unet_double_blocks_0_img_mlp_0": 4, "lora_unet_conv_in": 4}
    assert skipped == {"only_base": 0, "only_tuned": 1, "not a Linear / Conv2d weight": 1, "unchanged": 1}
    for key, stem in (("double_blocks.0.img_attn.qkv.weight", "lora_unet_double_blocks_0_img_attn_qkv"),
                      ("double_blocks.0.img_mlp.0.weight", "lora_unet_double_blocks_0_img_mlp_0"),
                      ("conv_in.weight", "lora_unet_conv_in")):
        up, down = out[f"{stem}.lora_up.weight"], out[f"{stem}.lora_down.weight"]
        s = float(out[f"{stem}.alpha"]) / down.shape[0]
        assert s == 1.0 and down.dtype == np.float32
        got = s * (up.reshape(up.shape[0], -1).astype(np.float64) @ down.reshape(down.shape[0], -1))
        want = (t[key].astype(np.float64) - b[key]).reshape(up.shape[0], -1)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert out["lora_unet_conv_in.lora_down.weight"].shape == (4, 4, 3, 3)
    assert out["lora_unet_conv_in.lora_up.weight"].shape == (8, 4, 1, 1)
    assert all(kept == pytest.approx(1.0, abs=1e-6) for _, _, kept in report)
    assert meta["ss_network_dim"] == "4"
    # a bfloat16 tuned checkpoint gives a bfloat16 LoRA (ml_dtypes' NumPy kind is 'V', not 'f')
    import ml_dtypes
    bf = _write(tmp_path / "tuned_bf16.safetensors", {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v
                                                       for k, v in t.items()})
    extract_files(base, bf, str(tmp_path / "bf.safetensors"), 2)
    out_bf, _ = _read(tmp_path / "bf.safetensors")
    assert {str(v.dtype) for v in out_bf.values()} == {"bfloat16"}
    # PEFT names, a dynamic rank: the qkv difference has rank 3, the MLP's 2
    report, _ = extract_files(base, tuned, str(tmp_path / "p.safetensors"), 8, format="peft", method="sv_fro",
                              param=0.999)
    assert {n: k for n, k, _ in report} == {"transformer.double_blocks.0.img_attn.qkv": 3,
                                            "transformer.double_blocks.0.img_mlp.0": 2, "transformer.conv_in": 2}
    out, _ = _read(tmp_path / "p.safetensors")
    assert "transformer.double_blocks.0.img_attn.qkv.lora_A.weight" in out


def test_the_randomized_svd():
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((600, 80)))
    v, _ = np.linalg.qr(rng.standard_normal((500, 80)))
    sv = 0.8 ** np.arange(80)
    w = (u * sv) @ v.T + 1e-9 * rng.standard_normal((600, 500))
    uu, s, vh = low_rank_svd(w, 16)
    assert uu.shape == (600, 16) and vh.shape == (16, 500)
    np.testing.assert_allclose(s, sv[:16], rtol=1e-6)
    exact = np.linalg.svd(w, compute_uv=False)
    np.testing.assert_allclose(np.linalg.norm(w - (uu * s) @ vh), np.sqrt(np.sum(exact[16:] ** 2)), rtol=1e-4)


def test_a_fine_tuned_tiny_flux_comes_back_as_a_lora(tmp_path):
    """The tiny Flux (diffusers layout) with a rank-2 change in two attention projections: the extracted PEFT LoRA,
    applied by generate to the base, gives the tuned model's image."""
    from flame_models.flux.tiny import tiny_flux_files
    from flame_models.generate import generate
    files = tiny_flux_files(tmp_path / "base", seed=1)
    root = os.path.dirname(files.transformer)
    tuned_root = tmp_path / "tuned"
    shutil.copytree(root, tuned_root)
    rel = os.path.relpath(files.transformer, root)   # the transformer's folder (a checkpoint may be a folder)
    (weights,) = [f for f in os.listdir(os.path.join(tuned_root, rel)) if f.endswith(".safetensors")]
    src = os.path.join(tuned_root, rel, weights)
    sd, meta = _read(src)
    rng = np.random.default_rng(2)
    changed = [k for k in sd if k.endswith(("attn.to_q.weight", "attn.to_out.0.weight"))][:2]
    assert len(changed) == 2
    for k in changed:
        sd[k] = (sd[k].astype(np.float64) + _low_rank(rng, *sd[k].shape, 2, 0.05)).astype(sd[k].dtype)
    io.save_file(sd, src, metadata=meta)
    lora = str(tmp_path / "extracted.safetensors")
    report, _ = extract_files(files.transformer, os.path.join(tuned_root, rel), lora, 4, format="peft")
    assert sorted(n for n, _, _ in report) == sorted("transformer." + k[:-len(".weight")] for k in changed)
    kw = dict(width=48, height=32, steps=2, seed=3, dtype="float32", progress=False, log=lambda *a: None)
    tuned = np.asarray(generate(str(tuned_root), "a cat", **kw)[0]).astype(int)
    applied = np.asarray(generate(root, "a cat", loras=[lora], **kw)[0]).astype(int)
    plain = np.asarray(generate(root, "a cat", **kw)[0]).astype(int)
    assert np.abs(applied - tuned).max() <= 1 and np.abs(plain - tuned).max() > 1


def test_what_extract_refuses(models, tmp_path, capsys):
    base, tuned, b, _ = models
    dst = tmp_path / "never.safetensors"
    other = dict(b, **{"conv_in.weight": np.ones((8, 4, 1, 1), np.float32)})
    with pytest.raises(ResizeError, match=r"conv_in.weight: \(8, 4, 3, 3\) in .*, \(8, 4, 1, 1\) in .*: not "
                                          r"checkpoints of one model"):
        extract_files(base, _write(tmp_path / "o.safetensors", other), str(dst), 4)
    with pytest.raises(ResizeError, match="hold the same weights"):
        extract_files(base, base, str(dst), 4)
    nan = dict(b, **{"final_layer.linear.weight": np.full((16, 16), np.nan, np.float32)})
    with pytest.raises(ResizeError, match=r"final_layer.linear.weight in .*n.safetensors: 256 of 256 values are not "
                                          r"finite"):
        extract_files(base, _write(tmp_path / "n.safetensors", nan), str(dst), 4)
    with pytest.raises(ResizeError, match="format: one of kohya, peft"):
        extract_files(base, tuned, str(dst), 4, format="lycoris")
    with pytest.raises(ResizeError, match="does not exist"):
        extract_files(str(tmp_path / "nope"), tuned, str(dst), 4)
    assert not dst.exists()
    assert main([base, tuned, str(tmp_path / "cli.safetensors"), "--rank", "2"]) == 0
    text = capsys.readouterr().out
    assert "3 adapters" in text and "left out: 1 only_tuned, 1 not a Linear / Conv2d weight, 1 unchanged" in text
    assert main([base, base, str(tmp_path / "cli.safetensors"), "--rank", "2"]) == 2
