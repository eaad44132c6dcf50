"""Every key FLAME writes in a Flux Kontext or Chroma LoRA file reaches a weight through ComfyUI's LoRA key map, with
tensors whose shapes fit that weight (or row range).

ComfyUI's rules, restated here (read from ComfyUI's comfy/lora.py `model_lora_keys_unet`, comfy/utils.py
`flux_to_diffusers` and comfy/model_base.py, where Flux Kontext runs on `model_base.Flux` and `model_base.Chroma`
subclasses `Flux`, so Flux's branch applies to both):
  kohya   every weight `diffusion_model.<name>.weight` of the model is reached by `lora_unet_<name with every dot made
          an underscore>`. ComfyUI's Flux and Chroma modules carry the names of the BFL / Chroma checkpoint files
          (it loads those files as they are), listed below by `comfy_weights`.
  PEFT    for a Flux-branch model, `transformer.<diffusers name>` reaches a BFL weight or a row range of it: the
          fused q|k|v Linears are split into to_q / to_k / to_v (and add_q_proj / ... for the text stream), a single
          block's linear1 into to_q / to_k / to_v and proj_mlp (rows 3H .. 3H + 4H), the final adaLN is
          norm_out.linear with its two halves swapped; the other names are `diffusers_names` below. Nothing maps
          diffusers' names of Chroma's approximator (distilled_guidance_layer.*): ComfyUI reads it from kohya files.
A file's up / lora_B must have the rows of what its name reaches, its down / lora_A the weight's columns.
"""
import os

import numpy as np
import pytest

import flame_nn.adapters as A
from flame_core import io

from .conftest import fixture_script

SUFFIXES = ("lora_down.weight", "lora_up.weight", "alpha")


def comfy_weights(arch, p):
    """{BFL / Chroma checkpoint weight name: (out, in)} of ComfyUI's model for FLAME params `p`."""
    H, M = p.hidden_size, int(p.hidden_size * p.mlp_ratio)
    w = {"img_in": (H, p.in_channels), "txt_in": (H, p.context_in_dim), "final_layer.linear": (p.out_channels, H)}
    for i in range(p.depth):
        for s in ("img", "txt"):
            w.update({f"double_blocks.{i}.{s}_attn.qkv": (3 * H, H), f"double_blocks.{i}.{s}_attn.proj": (H, H),
                      f"double_blocks.{i}.{s}_mlp.0": (M, H), f"double_blocks.{i}.{s}_mlp.2": (H, M)})
            if arch == "kontext":
                w[f"double_blocks.{i}.{s}_mod.lin"] = (6 * H, H)
    for i in range(p.depth_single_blocks):
        w.update({f"single_blocks.{i}.linear1": (3 * H + M, H), f"single_blocks.{i}.linear2": (H, H + M)})
        if arch == "kontext":
            w[f"single_blocks.{i}.modulation.lin"] = (3 * H, H)
    if arch == "kontext":
        w.update({"time_in.in_layer": (H, 256), "time_in.out_layer": (H, H), "vector_in.in_layer": (H, p.vec_in_dim),
                  "vector_in.out_layer": (H, H), "guidance_in.in_layer": (H, 256), "guidance_in.out_layer": (H, H),
                  "final_layer.adaLN_modulation.1": (2 * H, H)})
    else:
        D = p.approximator_hidden_dim
        w.update({"distilled_guidance_layer.in_proj": (D, p.approximator_in_dim),
                  "distilled_guidance_layer.out_proj": (H, D)})
        for i in range(p.approximator_layers):
            w.update({f"distilled_guidance_layer.layers.{i}.in_layer": (D, D),
                      f"distilled_guidance_layer.layers.{i}.out_layer": (D, D)})
    return w


def diffusers_names(p):
    """{diffusers name: (BFL name, (first row, end row) or None for all rows)}: ComfyUI's Flux map."""
    H = p.hidden_size
    qkv = lambda names, to: {n: (to, (k * H, (k + 1) * H)) for k, n in enumerate(names)}  # noqa: E731
    m = {"proj_out": ("final_layer.linear", None), "x_embedder": ("img_in", None), "context_embedder": ("txt_in", None),
         "norm_out.linear": ("final_layer.adaLN_modulation.1", None)}
    for emb, bfl in (("timestep_embedder", "time_in"), ("text_embedder", "vector_in"),
                     ("guidance_embedder", "guidance_in")):
        m[f"time_text_embed.{emb}.linear_1"] = (f"{bfl}.in_layer", None)
        m[f"time_text_embed.{emb}.linear_2"] = (f"{bfl}.out_layer", None)
    for i in range(p.depth):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        m.update(qkv([f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"], f"{b}.img_attn.qkv"))
        m.update(qkv([f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"], f"{b}.txt_attn.qkv"))
        for dn, bn in (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"),
                       ("norm1.linear", "img_mod.lin"), ("norm1_context.linear", "txt_mod.lin"),
                       ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                       ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2")):
            m[f"{d}.{dn}"] = (f"{b}.{bn}", None)
    for i in range(p.depth_single_blocks):
        s, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        m.update(qkv([f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v"], f"{b}.linear1"))
        m[f"{s}.proj_mlp"] = (f"{b}.linear1", (3 * H, 3 * H + 4 * H))
        m[f"{s}.norm.linear"] = (f"{b}.modulation.lin", None)
        m[f"{s}.proj_out"] = (f"{b}.linear2", None)
    return m


def _written(arch, fmt, targets, tmp_path):
    maker = fixture_script("make_kontext_chroma_lora_flame_files")
    model = maker.base_model(arch)
    A.inject_adapters(model, targets, rank=4, alpha=8.0)
    path = str(tmp_path / f"{arch}_{fmt}.safetensors")
    A.save_adapters(model, path, fmt)
    return {k: v.numpy() for k, v in io.load_file(path).items()}, model.params


def _groups(sd, split):
    out = {}
    for k, v in sd.items():
        base, suffix = split(k)
        out.setdefault(base, {})[suffix] = v
    return out


def comfy_kohya_problems(sd, weights):
    reach = {"lora_unet_" + n.replace(".", "_"): n for n in weights}
    problems = []
    for base, t in _groups(sd, lambda k: k.split(".", 1)).items():
        if base not in reach:
            problems.append(f"{base}: no weight of ComfyUI's model")
            continue
        out, inp = weights[reach[base]]
        if set(t) - set(SUFFIXES) or t["lora_up.weight"].shape[0] != out or t["lora_down.weight"].shape[1] != inp:
            problems.append(f"{base}: {sorted(t)} {[v.shape for v in t.values()]} do not fit {(out, inp)}")
    return problems


def comfy_peft_problems(sd, weights, names):
    problems = []
    for base, t in _groups(sd, lambda k: k.rsplit(".", 2)[0:1] + [".".join(k.rsplit(".", 2)[1:])]).items():
        name = base[len("transformer."):] if base.startswith("transformer.") else None
        if name not in names or names[name][0] not in weights:
            problems.append(f"{base}: not in ComfyUI's map for this model")
            continue
        bfl, rows = names[name]
        out, inp = weights[bfl]
        n = out if rows is None else rows[1] - rows[0]
        if set(t) != {"lora_A.weight", "lora_B.weight"} or t["lora_B.weight"].shape[0] != n \
                or t["lora_A.weight"].shape[1] != inp:
            problems.append(f"{base}: {[v.shape for v in t.values()]} do not fit rows {rows} of {bfl} {(out, inp)}")
    return problems


EVERY_LINEAR, ATTENTION = ["*"], ["to_q", "to_k", "to_v", "to_out.0"]


@pytest.mark.parametrize("arch", ["kontext", "chroma"])
@pytest.mark.parametrize("targets", [EVERY_LINEAR, ATTENTION], ids=["every_linear", "attention"])
def test_kohya_keys_reach_comfyuis_weights(arch, targets, tmp_path):
    sd, p = _written(arch, "kohya", targets, tmp_path)
    weights = comfy_weights(arch, p)
    assert comfy_kohya_problems(sd, weights) == []
    adapted = {k.split(".", 1)[0] for k in sd}
    if targets is EVERY_LINEAR:   # every Linear of ComfyUI's model was adapted and named
        assert adapted == {"lora_unet_" + n.replace(".", "_") for n in weights}


@pytest.mark.parametrize("arch", ["kontext", "chroma"])
@pytest.mark.parametrize("targets", [EVERY_LINEAR, ATTENTION], ids=["every_linear", "attention"])
def test_peft_keys_reach_comfyuis_weights(arch, targets, tmp_path):
    sd, p = _written(arch, "peft", targets, tmp_path)
    problems = comfy_peft_problems(sd, comfy_weights(arch, p), diffusers_names(p))
    if arch == "chroma" and targets is EVERY_LINEAR:
        # the approximator's diffusers names (distilled_guidance_layer.*) are not in ComfyUI's Flux map: an
        # approximator LoRA goes to ComfyUI in a kohya file (documented in docs/ARCHITECTURES.md)
        assert problems and all(q.startswith("transformer.distilled_guidance_layer.") for q in problems), problems
    else:
        assert problems == []


@pytest.mark.parametrize("name", ["kontext_kohya", "kontext_peft", "chroma_kohya", "chroma_peft", "kontext_kohya_outer",
                                  "chroma_kohya_approximator"])
def test_the_diffusers_fixture_files_reach_comfyuis_weights(name):
    """The files of tests/fixtures/kontext_chroma_lora (which diffusers loads) are read by ComfyUI too, except the
    Chroma PEFT file's approximator layers."""
    maker = fixture_script("make_kontext_chroma_lora_flame_files")
    arch, fmt = name.split("_")[:2]
    p = maker.base_model(arch).params
    sd = {k: v.numpy() for k, v in io.load_file(os.path.join(maker.OUT, f"{name}.safetensors")).items()}
    weights = comfy_weights(arch, p)
    if fmt == "kohya":
        assert comfy_kohya_problems(sd, weights) == []
    else:
        problems = comfy_peft_problems(sd, weights, diffusers_names(p))
        assert all(q.startswith("transformer.distilled_guidance_layer.") for q in problems) and \
            bool(problems) == (arch == "chroma"), problems


def test_a_misnamed_key_is_caught():
    """The checks above fail on names ComfyUI does not map and on rows that do not fit (so they can fail)."""
    from flame_models.bfl import FluxParams
    p = FluxParams(hidden_size=32, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=(4, 6, 6),
                   context_in_dim=16, vec_in_dim=8)
    weights, names = comfy_weights("kontext", p), diffusers_names(p)
    z = np.zeros
    assert comfy_kohya_problems({"lora_unet_double_blocks_0_img_attn_qkvx.lora_up.weight": z((96, 4)),
                                 "lora_unet_double_blocks_0_img_attn_qkvx.lora_down.weight": z((4, 32))}, weights)
    assert comfy_kohya_problems({"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": z((32, 4)),
                                 "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": z((4, 32))}, weights)
    assert comfy_peft_problems({"transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": z((96, 4)),
                                "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": z((4, 32))},
                               weights, names)
    assert comfy_peft_problems({"transformer.single_blocks.0.linear1.lora_B.weight": z((224, 4)),
                                "transformer.single_blocks.0.linear1.lora_A.weight": z((4, 32))}, weights, names)
    assert not comfy_peft_problems({"transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": z((128, 4)),
                                    "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": z((4, 32))},
                                   weights, names)
