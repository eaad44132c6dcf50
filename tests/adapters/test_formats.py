"""LoRA file layouts: kohya and PEFT round trips are exact; conversions keep the merged weights (float64)."""
import json

import numpy as np
import pytest

from flame_core import io
from flame_nn.adapters import formats as F
from flame_nn.adapters.formats import AdapterFormatError, AdapterPart, NameMap

OUT, IN, R = 12, 8, 2


def _lora(rng, out=OUT, inp=IN, r=R, alpha=1.0, rows=None, dora=False):
    t = {"lora_down.weight": rng.standard_normal((r, inp)).astype(np.float32),
         "lora_up.weight": rng.standard_normal((out, r)).astype(np.float32)}
    if dora:
        t["dora_scale"] = rng.uniform(0.5, 2.0, (out, 1)).astype(np.float32)
    return AdapterPart("dora" if dora else "lora", t, alpha, rows)


def _lokr(rng, full=False):
    t = {"lokr_w1": rng.standard_normal((3, 2)).astype(np.float32)}  # OUT = 3·4, IN = 2·4
    if full:
        t["lokr_w2"] = rng.standard_normal((4, 4)).astype(np.float32)
    else:
        t["lokr_w2_a"] = rng.standard_normal((4, R)).astype(np.float32)
        t["lokr_w2_b"] = rng.standard_normal((R, 4)).astype(np.float32)
    return AdapterPart("lokr", t, 4.0)


def _loha(rng):
    t = {"hada_w1_a": rng.standard_normal((OUT, R)), "hada_w1_b": rng.standard_normal((R, IN)),
         "hada_w2_a": rng.standard_normal((OUT, R)), "hada_w2_b": rng.standard_normal((R, IN))}
    return AdapterPart("loha", {k: v.astype(np.float32) for k, v in t.items()}, 3.0)


def _same(a, b):
    assert a.keys() == b.keys()
    for m in a:
        assert len(a[m]) == len(b[m])
        for p, q in zip(a[m], b[m]):
            assert (p.kind, p.alpha, p.rows) == (q.kind, q.alpha, q.rows), (m, p, q)
            assert p.tensors.keys() == q.tensors.keys()
            for k in p.tensors:
                np.testing.assert_array_equal(np.asarray(p.tensors[k]).reshape(np.shape(q.tensors[k])),
                                              q.tensors[k], err_msg=f"{m} {k}")


def test_part_math_against_definitions(rng):
    w = rng.standard_normal((OUT, IN))
    lo = _lora(rng, alpha=1.0)
    d = lo.tensors
    np.testing.assert_allclose(lo.merged_weight(w), w + 0.5 * d["lora_up.weight"].astype(float) @ d["lora_down.weight"])
    do = _lora(rng, dora=True, alpha=2.0)
    v = w + do.tensors["lora_up.weight"].astype(float) @ do.tensors["lora_down.weight"]
    m = do.tensors["dora_scale"].astype(float)
    np.testing.assert_allclose(do.merged_weight(w), m * v / np.sqrt((v * v).sum(1, keepdims=True)))
    np.testing.assert_allclose(np.linalg.norm(do.merged_weight(w), axis=1), m[:, 0], rtol=1e-12)
    k = _lokr(rng)
    w2 = k.tensors["lokr_w2_a"].astype(float) @ k.tensors["lokr_w2_b"]
    ref = np.zeros((OUT, IN))
    for a in range(3):
        for c in range(2):
            ref[a * 4:(a + 1) * 4, c * 4:(c + 1) * 4] = k.tensors["lokr_w1"][a, c] * w2
    np.testing.assert_allclose(k.delta_weight(), 2.0 * ref, rtol=1e-12)  # alpha 4 / rank 2
    assert _lokr(rng, full=True).scale == 1.0  # both factors full: alpha is ignored (LyCORIS, ComfyUI)
    h = _loha(rng)
    t = {kk: vv.astype(float) for kk, vv in h.tensors.items()}
    np.testing.assert_allclose(h.delta_weight(), 1.5 * (t["hada_w1_a"] @ t["hada_w1_b"]) *
                               (t["hada_w2_a"] @ t["hada_w2_b"]), rtol=1e-12)


@pytest.mark.parametrize("make", ["lora", "dora", "lokr", "lokr_full", "loha"])
def test_kohya_roundtrip_exact(make, rng, tmp_path):
    part = {"lora": lambda: _lora(rng, alpha=1.0), "dora": lambda: _lora(rng, dora=True, alpha=3.0),
            "lokr": lambda: _lokr(rng), "lokr_full": lambda: _lokr(rng, full=True), "loha": lambda: _loha(rng)}[make]()
    modules = {"blocks.0.attn.qkv": [part], "blocks.1.mlp_in": [_lora(rng, alpha=None)]}
    sd = F.to_kohya(modules)
    assert "lora_unet_blocks_0_attn_qkv.alpha" in sd and sd["lora_unet_blocks_0_attn_qkv.alpha"].shape == ()
    assert "lora_unet_blocks_1_mlp_in.alpha" not in sd  # no alpha: scale 1
    _same(F.from_kohya(sd, ["blocks.0.attn.qkv", "blocks.1.mlp_in", "blocks.2.other"]), modules)
    path = tmp_path / "a.safetensors"
    F.save(path, modules, "kohya", metadata={"flame.network_type": make})
    back, meta = F.load(path, ["blocks.0.attn.qkv", "blocks.1.mlp_in"])
    _same(back, modules)
    assert meta["flame.format"] == "kohya" and meta["flame.network_type"] == make


def test_kohya_key_names(rng):
    sd = F.to_kohya({"double_blocks.0.img_attn.qkv": [_lora(rng, dora=True)]})
    assert sorted(sd) == ["lora_unet_double_blocks_0_img_attn_qkv.alpha",
                          "lora_unet_double_blocks_0_img_attn_qkv.dora_scale",
                          "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                          "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.dora_scale"].shape == (OUT, 1)


QKV = NameMap({"blk.qkv": [("blk.to_q", [(0, 4)]), ("blk.to_k", [(4, 8)]), ("blk.to_v", [(8, 12)])],
               "blk.ada": [("blk.norm_out", [(6, 12), (0, 6)])]})


@pytest.mark.parametrize("alpha", [2.0, 0.5, None])
@pytest.mark.parametrize("dora", [False, True])
def test_peft_roundtrip_exact(alpha, dora, rng, tmp_path):
    modules = {"blk.qkv": [_lora(rng, alpha=alpha, dora=dora)], "blk.ada": [_lora(rng, alpha=alpha, dora=dora)],
               "blk.plain": [_lora(rng, alpha=alpha, dora=dora)]}
    path = tmp_path / "p.safetensors"
    F.save(path, modules, "peft", name_map=QKV)
    keys = io.safe_open(path).keys()
    assert "transformer.blk.to_q.lora_A.weight" in keys and "transformer.blk.plain.lora_B.weight" in keys
    assert not any(k.endswith(".alpha") for k in keys)  # PEFT files carry no alpha
    assert any(k.endswith(".lora_magnitude_vector") for k in keys) == dora
    parts, meta = F.load(path, list(modules), name_map=QKV)
    parts = {m: [F.fit_parts(parts[m], [(None, R)], m, OUT)[0]] for m in parts}  # the to_q/k/v share one down
    _same(parts, modules)
    assert json.loads(meta["flame.alphas"])["blk.to_q"] == [alpha, R]


def test_peft_scale_is_folded_for_other_readers(rng):
    """A reader that knows nothing of FLAME (diffusers, ComfyUI: scale 1 without alpha) sees the same ΔW, row by row
    of each split Linear."""
    w = rng.standard_normal((OUT, IN))
    for dora in (False, True):
        part = _lora(rng, alpha=0.5, dora=dora)
        sd, _ = F.to_peft({"blk.qkv": [part]}, QKV)
        whole = part.merged_weight(w)
        for name, lo, hi in (("to_q", 0, 4), ("to_k", 4, 8), ("to_v", 8, 12)):
            a = sd[f"transformer.blk.{name}.lora_A.weight"].astype(float)
            b = sd[f"transformer.blk.{name}.lora_B.weight"].astype(float)
            v = w[lo:hi] + b @ a
            if dora:  # PEFT's DoRA: magnitude times the row-normalised adapted weight
                m = sd[f"transformer.blk.{name}.lora_magnitude_vector"].astype(float)[:, None]
                v = m * v / np.linalg.norm(v, axis=1, keepdims=True)
            np.testing.assert_allclose(v, whole[lo:hi], rtol=1e-6, atol=1e-6)
    # the permuted module: diffusers' rows are (second half, first half)
    part = _lora(rng, alpha=1.0)
    sd, _ = F.to_peft({"blk.ada": [part]}, QKV)
    b = sd["transformer.blk.norm_out.lora_B.weight"]
    np.testing.assert_array_equal(b, 0.5 * np.concatenate([part.tensors["lora_up.weight"][6:],
                                                           part.tensors["lora_up.weight"][:6]]))


def test_kohya_peft_conversion_consistent(rng):
    """kohya file -> canonical -> PEFT -> canonical -> kohya file: identical tensors; and a PEFT file made of
    separate q/k/v LoRAs -> kohya block-diagonal -> back: identical, with the same merged weight."""
    w = rng.standard_normal((OUT, IN))
    kohya = F.to_kohya({"blk.qkv": [_lora(rng, alpha=4.0)]})
    canon = F.from_kohya(kohya, ["blk.qkv"])
    sd, alphas = F.to_peft(canon, QKV)
    back = F.from_peft(sd, QKV, alphas=alphas)
    back = {"blk.qkv": [F.fit_parts(back["blk.qkv"], [(None, R)], "blk.qkv", OUT)[0]]}
    again = F.to_kohya(back)
    assert again.keys() == kohya.keys()
    for k in kohya:
        np.testing.assert_array_equal(again[k], kohya[k])
    # separate LoRAs per q/k/v (different downs, as diffusers trains them)
    seg = {"blk.qkv": [_lora(rng, out=4, rows=(lo, lo + 4), alpha=1.0) for lo in (0, 4, 8)]}
    merged_seg = np.concatenate([p.merged_weight(w[p.rows[0]:p.rows[1]]) for p in seg["blk.qkv"]])
    kohya2 = F.to_kohya(seg, out_features={"blk.qkv": OUT})
    assert kohya2["lora_unet_blk_qkv.lora_down.weight"].shape == (3 * R, IN)
    assert float(kohya2["lora_unet_blk_qkv.alpha"]) == 0.5 * 3 * R  # same scale 1/2 at rank 6
    whole = F.from_kohya(kohya2, ["blk.qkv"])["blk.qkv"][0]
    np.testing.assert_allclose(whole.merged_weight(w), merged_seg, rtol=1e-12)
    split = F.fit_parts([whole], [((0, 4), R), ((4, 8), R), ((8, 12), R)], "blk.qkv", OUT)
    _same({"blk.qkv": split}, seg)


def test_segmented_dora_fills_uncovered_rows(rng):
    w = rng.standard_normal((OUT, IN))
    seg = [_lora(rng, out=4, rows=(0, 4), dora=True, alpha=1.0)]
    with pytest.raises(AdapterFormatError, match="row norms"):
        F.to_kohya({"m": seg}, out_features={"m": OUT})
    sd = F.to_kohya({"m": seg}, out_features={"m": OUT}, row_norms={"m": np.linalg.norm(w, axis=1)})
    whole = F.from_kohya(sd, ["m"])["m"][0]
    ref = w.copy()
    ref[0:4] = seg[0].merged_weight(w[0:4])
    np.testing.assert_allclose(whole.merged_weight(w), ref, rtol=1e-6, atol=1e-6)


def test_errors(rng, tmp_path):
    with pytest.raises(AdapterFormatError, match="lora_unet_nothing_here"):
        F.from_kohya({"lora_unet_nothing_here.lora_down.weight": np.zeros((1, 2))}, ["a.b"])
    with pytest.raises(AdapterFormatError, match="no PEFT/diffusers layout"):
        F.to_peft({"m": [_lokr(rng)]})
    with pytest.raises(AdapterFormatError, match="cannot tell the adapter kind"):
        F.from_kohya({"lora_unet_m.lora_down.weight": np.zeros((1, 2))}, ["m"])
    diff_downs = [_lora(rng, out=4, rows=(lo, lo + 4)) for lo in (0, 4, 8)]
    with pytest.raises(AdapterFormatError, match="different lora_A"):
        F.fit_parts(diff_downs, [(None, R)], "blk.qkv", OUT)
    full = _lora(rng, r=3 * R)
    with pytest.raises(AdapterFormatError, match="not block diagonal"):
        F.fit_parts([full], [((0, 4), R), ((4, 8), R), ((8, 12), R)], "blk.qkv", OUT)
    with pytest.raises(AdapterFormatError, match="rank 6.*ranks \\[3, 3, 3\\]"):
        F.fit_parts([full], [((0, 4), 3), ((4, 8), 3), ((8, 12), 3)], "blk.qkv", OUT)
    p = tmp_path / "x.safetensors"
    io.save_file({"model.weight": np.zeros(2, np.float32)}, p)
    with pytest.raises(AdapterFormatError, match="not a LoRA file"):
        F.load(p, ["model"])
