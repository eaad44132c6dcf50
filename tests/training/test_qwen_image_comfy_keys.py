"""Every key FLAME writes in a Qwen-Image LoRA file (kohya and PEFT; LoRA, DoRA, LoKr) reaches a weight through
ComfyUI's LoRA key map, with tensors whose shapes fit that weight.

ComfyUI's rules, restated here (read from ComfyUI's comfy/lora.py `model_lora_keys_unet`): for every weight
`diffusion_model.<name>.weight` of a model, `lora_unet_<name with every dot made an underscore>` and `<name>` reach
it; for a `model_base.QwenImage` also `transformer.<name>` and `lycoris_<name with underscores>`. ComfyUI's Qwen-Image
modules carry the release's names (it loads the release's files as they are), which are diffusers' and FLAME's
(docs/ARCHITECTURES.md, checkpoint layouts; FLAME loads those files key for key, tests/models/test_qwen_image_model.py),
so ComfyUI's weights are the Linear weights of FLAME's model under the same names. ComfyUI's loader then reads
`<key>.lora_up.weight` / `.lora_down.weight` / `.alpha` (and `.dora_scale`), `<key>.lora_A.weight` / `.lora_B.weight`,
`<key>.lokr_w1` / `.lokr_w2` (or their `_a` / `_b` factors). It reads DoRA's magnitude as kohya's `dora_scale`
only: a PEFT DoRA file's `lora_magnitude_vector` is left unread there (ComfyUI would apply the plain LoRA), so a
DoRA for ComfyUI is saved with save.format kohya."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn
import flame_nn.adapters as A
from flame_core import io
from flame_models.qwen_image import QwenImageTransformer2DModel

KOHYA = ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale", "lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b",
         "lokr_w2_a", "lokr_w2_b")
PEFT = ("lora_A.weight", "lora_B.weight")


def comfy_weights(model):
    """{name: (out, in)} of every Linear weight of ComfyUI's Qwen-Image model (= FLAME's, see the docstring)."""
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, flame_nn.Linear)}


def comfy_key_map(weights):
    """ComfyUI's key -> weight name for a QwenImage model (comfy/lora.py, restated)."""
    m = {}
    for n in weights:
        for key in ("lora_unet_" + n.replace(".", "_"), n, "transformer." + n, "lycoris_" + n.replace(".", "_")):
            m[key] = n
    return m


def _written(fmt, kind, targets, tmp_path):
    flame.manual_seed(0)
    model = QwenImageTransformer2DModel("qwen-image-tiny", dtype=flame.float32, device="cpu")
    weights = comfy_weights(model)
    kw = {"lokr": dict(rank=4, alpha=4.0, lokr_factor=4)}.get(kind, dict(rank=4, alpha=8.0))
    A.inject_adapters(model, targets, kind, **kw)
    path = str(tmp_path / f"qwen_{kind}_{fmt}.safetensors")
    A.save_adapters(model, path, fmt)
    return {k: v.numpy() for k, v in io.load_file(path).items()}, weights


def _split(key, suffixes):
    for s in sorted(suffixes, key=len, reverse=True):
        if key.endswith("." + s):
            return key[:-len(s) - 1], s
    return key, None


def comfy_problems(sd, weights, suffixes):
    reach = comfy_key_map(weights)
    groups, problems = {}, []
    for k, v in sd.items():
        base, suffix = _split(k, suffixes)
        if suffix is None:
            problems.append(f"{k}: ComfyUI's loader does not read it")
            continue
        groups.setdefault(base, {})[suffix] = v
    for base, t in groups.items():
        if base not in reach:
            problems.append(f"{base}: not in ComfyUI's key map for Qwen-Image")
            continue
        out, inp = weights[reach[base]]
        up, down = t.get("lora_up.weight", t.get("lora_B.weight")), t.get("lora_down.weight", t.get("lora_A.weight"))
        if up is not None and (up.shape[0] != out or down is None or down.shape[1] != inp):
            problems.append(f"{base}: {[(s, v.shape) for s, v in t.items()]} do not fit {(out, inp)}")
        if "lokr_w1" in t or "lokr_w1_a" in t:
            w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
            w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
            if np.kron(w1, w2).shape != (out, inp):
                problems.append(f"{base}: kron {w1.shape} x {w2.shape} does not make {(out, inp)}")
    return problems


EVERY_LINEAR, ATTENTION = ["*"], ["to_q", "to_k", "to_v", "to_out.0"]


@pytest.mark.parametrize("fmt, kind", [("kohya", "lora"), ("peft", "lora"), ("kohya", "dora"), ("kohya", "lokr")])
@pytest.mark.parametrize("targets", [EVERY_LINEAR, ATTENTION], ids=["every_linear", "attention"])
def test_every_key_reaches_a_comfyui_weight(fmt, kind, targets, tmp_path):
    sd, weights = _written(fmt, kind, targets, tmp_path)
    assert sd
    assert comfy_problems(sd, weights, KOHYA if fmt == "kohya" else PEFT) == []
    bases = {_split(k, KOHYA if fmt == "kohya" else PEFT)[0] for k in sd}
    reach = comfy_key_map(weights)
    if targets is EVERY_LINEAR:              # every Linear of ComfyUI's model was adapted and named
        assert {reach[b] for b in bases} == set(weights)
    else:
        assert {reach[b].rsplit(".attn.", 1)[1] for b in bases} == set(ATTENTION)


def test_a_peft_dora_files_magnitudes_are_what_comfyui_leaves_unread(tmp_path):
    sd, weights = _written("peft", "dora", ATTENTION, tmp_path)
    magnitudes = sorted(k for k in sd if k.endswith(".lora_magnitude_vector"))
    assert len(magnitudes) == 4 * 2                                       # 4 Linears in each of the 2 blocks
    assert sorted(comfy_problems(sd, weights, PEFT)) == [f"{k}: ComfyUI's loader does not read it" for k in magnitudes]


def test_the_check_finds_names_comfyui_does_not_map(tmp_path):
    sd, weights = _written("peft", "lora", ATTENTION, tmp_path)
    bad = {k.replace("transformer.", "base_model.model.", 1): v for k, v in sd.items()}
    assert comfy_problems(bad, weights, PEFT)[0].endswith("not in ComfyUI's key map for Qwen-Image")
    short = {k: (v[:-1] if k.endswith("lora_B.weight") else v) for k, v in sd.items()}
    assert "do not fit" in comfy_problems(short, weights, PEFT)[0]
