"""Resizing and merging LoRA files (flame_nn/adapters/resize.py and merge.py: kohya's resize_lora and
svd_merge_lora): the new factors against the best rank-k approximation of each ΔW computed here from the whole
matrix, the scale kept (kohya alpha' = s·k; PEFT s folded into lora_B, its scale metadata dropped, read back with
FLAME's loader), kohya's dynamic rank rules on factors of known singular values, LoCon convolutions and text-encoder
parts, merges as exact weighted sums or their rank-k approximations, and the refusals (DoRA / LoKr, mixed layouts,
non-finite values, bad options) before anything is written."""
import json
import os

import numpy as np
import pytest
from lora_files import read as _read
from lora_files import write as _write

from flame_nn.adapters import formats as F
from flame_nn.adapters.resize import ResizeError, factor_svd, main, new_rank, resize_file


def _delta(up, down, s=1.0):
    up, down = np.asarray(up, np.float64), np.asarray(down, np.float64)
    return s * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1))


def _best(w, k):
    u, s, vh = np.linalg.svd(w, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


@pytest.fixture
def kohya(tmp_path):
    rng = np.random.default_rng(0)
    sd = {"lora_unet_blocks_0_attn_qkv.lora_down.weight": rng.standard_normal((8, 40)),
          "lora_unet_blocks_0_attn_qkv.lora_up.weight": rng.standard_normal((30, 8)),
          "lora_unet_blocks_0_attn_qkv.alpha": np.asarray(4.0),
          "lora_unet_conv_in.lora_down.weight": rng.standard_normal((6, 5, 3, 3)),
          "lora_unet_conv_in.lora_up.weight": rng.standard_normal((12, 6, 1, 1)),
          "lora_unet_conv_in.alpha": np.asarray(6.0),
          "lora_te1_text_model_encoder_layers_0_q_proj.lora_down.weight": rng.standard_normal((8, 16)),
          "lora_te1_text_model_encoder_layers_0_q_proj.lora_up.weight": rng.standard_normal((16, 8))}
    sd = {k: v.astype(np.float32) for k, v in sd.items()}
    return _write(tmp_path / "kohya.safetensors", sd, {"ss_network_dim": "8", "ss_network_alpha": "4"}), sd


def test_kohya_factors_are_the_best_rank_k_approximation(kohya, tmp_path):
    src, sd = kohya
    report = resize_file(src, str(tmp_path / "out.safetensors"), 4, conv_rank=3)
    out, meta = _read(tmp_path / "out.safetensors")
    assert set(out) == set(sd) | {"lora_te1_text_model_encoder_layers_0_q_proj.alpha"}
    for stem, r, k, alpha in (("lora_unet_blocks_0_attn_qkv", 8, 4, 4.0), ("lora_unet_conv_in", 6, 3, 6.0),
                              ("lora_te1_text_model_encoder_layers_0_q_proj", 8, 4, None)):
        s = 1.0 if alpha is None else alpha / r
        want = _best(_delta(sd[f"{stem}.lora_up.weight"], sd[f"{stem}.lora_down.weight"], s), k)
        down, up = out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"]
        assert down.shape[0] == k and up.shape[1] == k and down.dtype == np.float32
        assert up.ndim == sd[f"{stem}.lora_up.weight"].ndim
        assert down.shape[1:] == sd[f"{stem}.lora_down.weight"].shape[1:]
        new_alpha = float(out[f"{stem}.alpha"])
        assert new_alpha == pytest.approx(s * k)                  # kohya's alpha' = s k: the scale is kept
        got = _delta(up, down, new_alpha / k)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert {n: (r, k) for n, r, k, _, _ in report} == {
        "lora_unet_blocks_0_attn_qkv": (8, 4), "lora_unet_conv_in": (6, 3),
        "lora_te1_text_model_encoder_layers_0_q_proj": (8, 4)}
    assert all(0 < kept < 1 for _, _, _, kept, _ in report)
    assert json.loads(meta["flame.resized"]) == {"from": 8, "to": 4, "method": None, "param": None}
    assert meta["ss_network_dim"] == "4"


def test_a_rank_at_or_above_the_adapters_keeps_it_exactly(kohya, tmp_path):
    src, sd = kohya
    report = resize_file(src, str(tmp_path / "same.safetensors"), 64, dtype="bfloat16")
    out, _ = _read(tmp_path / "same.safetensors")
    assert {n: k for n, _, k, _, _ in report}["lora_unet_conv_in"] == 6     # never above an adapter's own rank
    assert sorted(k for _, _, k, _, _ in report) == [6, 8, 8]
    stem = "lora_unet_blocks_0_attn_qkv"
    assert str(out[f"{stem}.lora_down.weight"].dtype) == "bfloat16"
    want = _delta(sd[f"{stem}.lora_up.weight"], sd[f"{stem}.lora_down.weight"], 0.5)
    got = _delta(out[f"{stem}.lora_up.weight"].astype(np.float32), out[f"{stem}.lora_down.weight"].astype(np.float32),
                 float(out[f"{stem}.alpha"].astype(np.float32)) / 8)
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()        # bfloat16 rounding of the factors
    assert all(kept == pytest.approx(1.0) for _, _, _, kept, _ in report)


def _known(singular, out=20, inn=24, seed=1):
    """(up, down) whose product has exactly these singular values."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((out, len(singular))))
    v, _ = np.linalg.qr(rng.standard_normal((inn, len(singular))))
    return u * np.asarray(singular), v.T


def test_the_dynamic_rules_are_kohyas():
    sv = [10.0, 5.0, 1.0, 0.5, 0.1]
    up, down = _known(sv)
    _, s, _ = factor_svd(up, down)
    np.testing.assert_allclose(s, sv, rtol=1e-12)
    # sv_ratio 8: the values above 10 / 8 (50: above 0.2); sv_fro 0.9: (100 + 25) / 126.26 >= 0.81 at the second value;
    # sv_cumulative 0.9: 15 / 16.6 >= 0.9 at the second, 0.95 needs the third (16 / 16.6)
    assert new_rank(s, 8, "sv_ratio", 8) == 2 and new_rank(s, 8, "sv_ratio", 50) == 4
    assert new_rank(s, 8, "sv_fro", 0.9) == 2 and new_rank(s, 8, "sv_fro", 0.999) == 4
    assert new_rank(s, 8, "sv_cumulative", 0.9) == 2 and new_rank(s, 8, "sv_cumulative", 0.95) == 3
    assert new_rank(s, 1, "sv_fro", 0.999) == 1                       # --rank is the most kept
    assert new_rank(s, 8, "sv_cumulative", 1.0) == 5 and new_rank(s, 3) == 3
    assert new_rank(np.zeros(4), 8) == 1                              # a zero product: rank 1


def test_dynamic_ranks_in_a_file(tmp_path):
    big, small = _known([10.0, 5.0, 1.0, 0.5, 0.1]), _known([3.0, 2.9, 2.8, 0.01], seed=2)
    src = _write(tmp_path / "dyn.safetensors",
                 {"lora_unet_a.lora_down.weight": big[1], "lora_unet_a.lora_up.weight": big[0],
                  "lora_unet_b.lora_down.weight": small[1], "lora_unet_b.lora_up.weight": small[0]},
                 {"ss_network_dim": "5"})
    report = resize_file(src, str(tmp_path / "o.safetensors"), 16, method="sv_fro", param=0.95)
    assert [(n, k) for n, _, k, _, _ in report] == [("lora_unet_a", 2), ("lora_unet_b", 3)]
    _, meta = _read(tmp_path / "o.safetensors")
    assert meta["ss_network_dim"] == "Dynamic" and json.loads(meta["flame.resized"])["to"] == "dynamic"


def test_peft_files_fold_their_scale(tmp_path):
    """A PEFT file whose transformer's scale comes from diffusers' LoraConfig metadata (lora_alpha 16, r 8: s = 2;
    its text encoder has no config: s = 1): resized, s is in lora_B, the metadata is gone, and FLAME's reader (s = 1
    without it) gets the best rank-k ΔW of each."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((24, 8)).astype(np.float32)
    te_a, te_b = rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((12, 8)).astype(np.float32)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 8, "transformer.lora_alpha": 16})}
    src = _write(tmp_path / "peft.safetensors",
                 {"transformer.blocks.0.to_q.lora_A.weight": a, "transformer.blocks.0.to_q.lora_B.weight": b,
                  "text_encoder.layers.0.q_proj.lora_A.weight": te_a,
                  "text_encoder.layers.0.q_proj.lora_B.weight": te_b}, meta)
    dst = str(tmp_path / "peft3.safetensors")
    report = resize_file(src, dst, 3)
    assert sorted((n, r, k) for n, r, k, _, _ in report) == [("text_encoder.layers.0.q_proj", 8, 3),
                                                              ("transformer.blocks.0.to_q", 8, 3)]
    out, meta2 = _read(dst)
    assert "lora_adapter_metadata" not in meta2 and sorted(out) == sorted(
        ["transformer.blocks.0.to_q.lora_A.weight", "transformer.blocks.0.to_q.lora_B.weight",
         "text_encoder.layers.0.q_proj.lora_A.weight", "text_encoder.layers.0.q_proj.lora_B.weight"])
    mods, _ = F.load(dst, ["blocks.0.to_q"])
    (part,) = mods["blocks.0.to_q"]
    assert part.alpha is None and part.rank == 3
    got = _delta(part.tensors["lora_up.weight"], part.tensors["lora_down.weight"])
    want = _best(_delta(b, a, 2.0), 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    te, _ = F.load(dst, ["layers.0.q_proj"], component="te1")
    np.testing.assert_allclose(_delta(te["layers.0.q_proj"][0].tensors["lora_up.weight"],
                                      te["layers.0.q_proj"][0].tensors["lora_down.weight"]),
                               _best(_delta(te_b, te_a), 3), rtol=0, atol=1e-5)


def test_flames_own_peft_files(tmp_path):
    """FLAME's PEFT writer records its alphas (flame.alphas) and folds s into lora_B; the resize reads them through
    the same path and drops them."""
    rng = np.random.default_rng(4)
    part = F.AdapterPart("lora", {"lora_down.weight": rng.standard_normal((4, 10)).astype(np.float32),
                                  "lora_up.weight": rng.standard_normal((6, 4)).astype(np.float32)}, alpha=3.0)
    src = F.save(str(tmp_path / "flame.safetensors"), {"lin": [part]}, "peft")
    assert "flame.alphas" in _read(src)[1]
    resize_file(src, str(tmp_path / "r2.safetensors"), 2)
    out, meta = _read(tmp_path / "r2.safetensors")
    assert "flame.alphas" not in meta
    want = _best(_delta(part.tensors["lora_up.weight"], part.tensors["lora_down.weight"], 0.75), 2)
    got = _delta(out["transformer.lin.lora_B.weight"], out["transformer.lin.lora_A.weight"])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_what_resize_refuses(kohya, tmp_path):
    src, sd = kohya
    dst = tmp_path / "never.safetensors"
    for kw, msg in (({"rank": 0}, "rank: a positive int, got 0"), ({"rank": 4, "method": "sv_fro"},
                                                                     "method sv_fro needs a number param"),
                    ({"rank": 4, "method": "sv_fro", "param": 1.5}, "sv_fro keeps a fraction 0 < param <= 1"),
                    ({"rank": 4, "method": "sv_ratio", "param": 0.5}, "sv_ratio keeps .* param > 1"),
                    ({"rank": 4, "param": 0.5}, "param 0.5 without a method"),
                    ({"rank": 4, "method": "svd"}, "method: one of sv_ratio, sv_cumulative, sv_fro"),
                    ({"rank": 4, "dtype": "float64"}, "dtype: one of float32, float16, bfloat16")):
        with pytest.raises(ResizeError, match=msg):
            resize_file(src, str(dst), **kw)
    dora = dict(sd, **{"lora_unet_conv_in.dora_scale": np.ones((12, 1), np.float32)})
    with pytest.raises(ResizeError, match="lora_unet_conv_in.dora_scale: a DoRA magnitude; only LoRA / LoCon adapters"):
        resize_file(_write(tmp_path / "dora.safetensors", dora), str(dst), 4)
    lokr = {"lora_unet_x.lokr_w1": np.ones((2, 2), np.float32), "lora_unet_x.lokr_w2": np.ones((3, 3), np.float32)}
    with pytest.raises(ResizeError, match="lora_unet_x.lokr_w1: a LoKr / LoHa factor"):
        resize_file(_write(tmp_path / "lokr.safetensors", lokr), str(dst), 4)
    nan = dict(sd)
    nan["lora_unet_blocks_0_attn_qkv.lora_up.weight"] = np.full((30, 8), np.nan, np.float32)
    with pytest.raises(ResizeError, match=r"nan.safetensors: lora_unet_blocks_0_attn_qkv.lora_up.weight: 240 of 240 "
                                          r"values are not finite"):
        resize_file(_write(tmp_path / "nan.safetensors", nan), str(dst), 4)
    with pytest.raises(F.AdapterFormatError, match="not a LoRA file"):
        resize_file(_write(tmp_path / "other.safetensors", {"weight": np.ones(3, np.float32)}), str(dst), 4)
    assert not dst.exists()


def test_the_command(kohya, tmp_path, capsys):
    src, _ = kohya
    dst = str(tmp_path / "cli.safetensors")
    assert main([src, dst, "--rank", "2", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "lora_unet_conv_in" in text and "rank 6 -> 2" in text and "3 adapters, rank 8 -> 2" in text
    assert os.path.exists(dst)
    assert main([src, dst, "--rank", "2", "--method", "sv_fro"]) == 2
    assert "needs a number param" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([src, str(tmp_path / "x.pt"), "--rank", "2"])
    assert e.value.code == 2


# ----------------------------------------------------------------------------- merging (flame_nn/adapters/merge.py)
def test_merging_sums_the_weighted_products(kohya, tmp_path):
    """Two kohya files with weights: exactly the weighted sum of their ΔW (an adapter only one file has is its own,
    weighted); with --rank, the best rank-k approximation of that sum; scale 1 (alpha = rank)."""
    from flame_nn.adapters.merge import merge_files
    src, sd = kohya
    rng = np.random.default_rng(9)
    other = {"lora_unet_blocks_0_attn_qkv.lora_down.weight": rng.standard_normal((4, 40)).astype(np.float32),
             "lora_unet_blocks_0_attn_qkv.lora_up.weight": rng.standard_normal((30, 4)).astype(np.float32),
             "lora_unet_blocks_0_attn_qkv.alpha": np.asarray(8.0, np.float32)}
    b = _write(tmp_path / "b.safetensors", other)
    stem = "lora_unet_blocks_0_attn_qkv"
    want = (0.7 * _delta(sd[f"{stem}.lora_up.weight"], sd[f"{stem}.lora_down.weight"], 0.5)
            + 0.5 * _delta(other[f"{stem}.lora_up.weight"], other[f"{stem}.lora_down.weight"], 2.0))
    report = merge_files([(src, 0.7), (b, 0.5)], str(tmp_path / "m.safetensors"))
    out, meta = _read(tmp_path / "m.safetensors")
    assert {n: (t, k) for n, t, k, _ in report}[stem] == (12, 12)
    assert float(out[f"{stem}.alpha"]) == 12.0
    np.testing.assert_allclose(_delta(out[f"{stem}.lora_up.weight"], out[f"{stem}.lora_down.weight"]), want,
                               rtol=0, atol=1e-5 * np.abs(want).max())
    conv = _delta(sd["lora_unet_conv_in.lora_up.weight"], sd["lora_unet_conv_in.lora_down.weight"], 1.0)
    np.testing.assert_allclose(_delta(out["lora_unet_conv_in.lora_up.weight"],
                                      out["lora_unet_conv_in.lora_down.weight"]), 0.7 * conv, rtol=0, atol=1e-5)
    assert json.loads(meta["flame.merged"])["sources"] == [["kohya.safetensors", 0.7], ["b.safetensors", 0.5]]
    merge_files([(src, 0.7), (b, 0.5)], str(tmp_path / "m5.safetensors"), 5)
    out5, _ = _read(tmp_path / "m5.safetensors")
    assert out5[f"{stem}.lora_down.weight"].shape == (5, 40) and float(out5[f"{stem}.alpha"]) == 5.0
    np.testing.assert_allclose(_delta(out5[f"{stem}.lora_up.weight"], out5[f"{stem}.lora_down.weight"]),
                               _best(want, 5), rtol=0, atol=1e-5 * np.abs(want).max())


def test_what_merge_refuses(kohya, tmp_path, capsys):
    from flame_nn.adapters.merge import main as merge_main
    from flame_nn.adapters.merge import merge_files
    from flame_nn.adapters.resize import parse_source
    src, sd = kohya
    peft = _write(tmp_path / "p.safetensors", {"transformer.x.lora_A.weight": np.ones((2, 3), np.float32),
                                              "transformer.x.lora_B.weight": np.ones((4, 2), np.float32)})
    with pytest.raises(ResizeError, match="the files mix layouts"):
        merge_files([src, peft], str(tmp_path / "never.safetensors"))
    wide = {"lora_unet_conv_in.lora_down.weight": np.ones((2, 5, 1, 1), np.float32),
            "lora_unet_conv_in.lora_up.weight": np.ones((12, 2, 1, 1), np.float32)}
    with pytest.raises(ResizeError, match=r"lora_unet_conv_in: .*kohya.safetensors has up .* not one layer's"):
        merge_files([src, _write(tmp_path / "w.safetensors", wide)], str(tmp_path / "never.safetensors"))
    with pytest.raises(ResizeError, match="give rank too"):
        merge_files([src], str(tmp_path / "never.safetensors"), method="sv_fro", param=0.9)
    with pytest.raises(ResizeError, match="the weight nan is not a finite number"):
        merge_files([(src, float("nan"))], str(tmp_path / "never.safetensors"))
    assert not (tmp_path / "never.safetensors").exists()
    assert parse_source("a/b.safetensors:0.5") == ("a/b.safetensors", 0.5)
    assert parse_source("C:/x.safetensors") == ("C:/x.safetensors", 1.0)
    assert merge_main([str(tmp_path / "cli.safetensors"), f"{src}:0.5", src, "--rank", "2"]) == 0
    assert "3 adapters from 2 files, rank 2" in capsys.readouterr().out
    assert merge_main([str(tmp_path / "cli.safetensors"), src, peft]) == 2
    assert "mix layouts" in capsys.readouterr().err


def test_a_dtype_option_rounds_once(tmp_path):
    """bfloat16 factors resized with dtype='float32': the new factors are the float64 SVD rounded once to float32,
    not through the file's bfloat16 first."""
    import ml_dtypes
    rng = np.random.default_rng(11)
    sd = {"lora_unet_x.lora_down.weight": rng.standard_normal((6, 20)).astype(ml_dtypes.bfloat16),
          "lora_unet_x.lora_up.weight": rng.standard_normal((10, 6)).astype(ml_dtypes.bfloat16)}
    src = _write(tmp_path / "bf16.safetensors", sd)
    resize_file(src, str(tmp_path / "f32.safetensors"), 3, dtype="float32")
    out, _ = _read(tmp_path / "f32.safetensors")
    up, down = out["lora_unet_x.lora_up.weight"], out["lora_unet_x.lora_down.weight"]
    assert up.dtype == np.float32 and down.dtype == np.float32 and out["lora_unet_x.alpha"].dtype == np.float32
    want = _best(_delta(sd["lora_unet_x.lora_up.weight"].astype(np.float64),
                        sd["lora_unet_x.lora_down.weight"].astype(np.float64)), 3)
    np.testing.assert_allclose(_delta(up, down), want, rtol=0, atol=1e-5 * np.abs(want).max())   # bf16: ~1e-2
    resize_file(src, str(tmp_path / "same.safetensors"), 3)
    kept, _ = _read(tmp_path / "same.safetensors")
    assert str(kept["lora_unet_x.lora_up.weight"].dtype) == "bfloat16"
