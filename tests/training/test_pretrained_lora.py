"""network.pretrained_lora_path (ai-toolkit's name; kohya's --network_weights with --dim_from_weights): a run starts
from a LoRA file's adapters -- its layers, row ranges, kinds, per-layer ranks, scales and values -- and trains them on;
what the config leaves out is taken from the file, what it gives must agree, and every problem of the file is a
ConfigError naming it before anything is cached or built (tiny Flux on the cpu)."""
import math
from collections import Counter

import numpy as np
import pytest
import yaml

import flame_nn.adapters as A
from flame_core import io
from flame_models import train as train_command
from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from . import test_sd_families as _families
from .conftest import tiny_config

# that file's SDXL fixtures (bound by assignment: the tests' arguments of the same name are what pytest fills)
images, sdxl_model, sdxl_config = _families.images, _families.sdxl_model, _families.sdxl_config

NETWORK = ("network.type", "network.linear", "network.linear_alpha", "network.target")


def _first(tmp_path, name="first", steps=3, fmt="kohya", **network):
    """A trained LoRA file (rank 4, alpha 2, every block Linear unless `network` says otherwise)."""
    c = tiny_config(tmp_path, name, steps=steps, save={"format": fmt}, network={"linear_alpha": 2, **network})
    return Trainer(c, verbose=False).train()["lora"]


def _on(tmp_path, name, path, steps=3, **network):
    """A run on `path`: the helper's network settings left out but those `network` gives."""
    drop = [k for k in NETWORK if k.split(".")[1] not in network]
    return tiny_config(tmp_path, name, steps=steps, drop=drop, network={"pretrained_lora_path": path, **network})


def _deltas(modules, model):
    """{module: ΔW of the whole module (float64)} of canonical adapters (row parts placed at their rows)."""
    out = {}
    for m, parts in modules.items():
        w = model.get_submodule(m).weight
        d = out.setdefault(m, np.zeros(tuple(w.shape[:2]), np.float64))
        for p in parts:
            lo, hi = p.rows or (0, w.shape[0])
            d[lo:hi] += p.delta_weight().reshape(hi - lo, -1)[:, :d.shape[1]] if p.kind != "dora" else 0
    return out


def _file_modules(tr, path):
    names = [n for n, _ in tr.model.named_modules()]
    return A.formats.load(path, names, name_map=tr.name_map)[0]


def _assert_same_adapters(tr, path):
    got, want = _deltas(A.adapter_state(tr.model), tr.model), _deltas(_file_modules(tr, path), tr.model)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-9, err_msg=str(k))


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_a_run_starts_from_the_files_adapters_and_trains_them_on(tmp_path, fmt):
    path = _first(tmp_path, fmt=fmt)
    tr = Trainer(_on(tmp_path, "second", path), verbose=False).setup()
    n = tr.cfg.network
    assert (n.type, n.linear, n.linear_alpha) == ("lora", 4, 2.0)        # settled from the file
    _assert_same_adapters(tr, path)
    assert {(ad.rank, ad.scale) for _, _, ad in A.adapter_modules(tr.model)} == {(4, 0.5)}
    # the model starts as the file's: its first loss is the loss of the first run's model on the same batch
    fresh = Trainer(tiny_config(tmp_path, "fresh", network={"linear_alpha": 2}), verbose=False).setup()
    assert A.load_adapters(fresh.model, path, name="file") is not None
    A.set_adapters(fresh.model, ["file"])
    assert tr.train_step()[0] == pytest.approx(fresh.train_step()[0], rel=1e-5)
    result = tr.train()
    assert np.isfinite(result["losses"]).all()
    # the same layers, trained on (written in the family's default layout, kohya, whatever the file's)
    before = _deltas(_file_modules(tr, path), tr.model)
    after = _deltas(_file_modules(tr, result["lora"]), tr.model)
    assert set(after) == set(before)
    assert all(np.abs(after[k] - before[k]).max() > 0 for k in before)
    assert io.load_metadata(result["lora"])["flame.rank"] == "4"


def _handmade(tmp_path, ranks=(4, 2, 1), scale=0.25, kind="lora"):
    """A PEFT file (diffusers names: Flux's fused qkv carved into to_q / to_k / to_v rows) with random values whose
    ranks cycle through `ranks` layer by layer -- a resized LoRA's -- at one scale."""
    probe = Trainer(tiny_config(tmp_path, "probe", network={"target": "attention"}), verbose=False).setup()
    rng = np.random.default_rng(0)
    state = {}
    for i, (mod, parts) in enumerate(A.adapter_state(probe.model).items()):
        r = ranks[i % len(ranks)]
        out = []
        for p in parts:
            o, n_in = p.shape
            t = {"lora_down.weight": rng.standard_normal((r, n_in)).astype(np.float32),
                 "lora_up.weight": rng.standard_normal((o, r)).astype(np.float32) * 0.1}
            out.append(A.AdapterPart(kind, t, scale * r, p.rows))
        state[mod] = out
    path = str(tmp_path / "handmade.safetensors")
    A.formats.save(path, state, "peft", name_map=probe.name_map,
                   out_features={k: probe.model.get_submodule(k).weight.shape[0] for k in state})
    return path, state


def test_per_layer_ranks_and_row_ranges_load_as_the_file_has_them(tmp_path):
    path, state = _handmade(tmp_path)
    assert any(p.rows is not None for parts in state.values() for p in parts)   # to_q / to_k / to_v rows of qkv
    tr = Trainer(_on(tmp_path, "ranks", path), verbose=False).setup()
    _assert_same_adapters(tr, path)
    ranks = [ad.rank for _, _, ad in A.adapter_modules(tr.model)]
    assert set(ranks) == {4, 2, 1} and ranks == [p.rank for parts in state.values() for p in parts]
    common = Counter(ranks).most_common(1)[0][0]
    assert tr.cfg.network.linear == common                                # the most common rank
    assert tr.cfg.network.linear_alpha == pytest.approx(0.25 * common)    # its alpha: the scale x rank
    assert np.isfinite(tr.train_step()[0])


def test_rslora_and_dropout_apply_and_each_layer_keeps_its_scale(tmp_path):
    path, _ = _handmade(tmp_path)
    tr = Trainer(_on(tmp_path, "rs", path, rslora=True, dropout=0.1), verbose=False).setup()
    for _, _, ad in A.adapter_modules(tr.model):
        assert ad.rslora and ad.dropout == 0.1 and ad.scale == pytest.approx(0.25)
    _assert_same_adapters(tr, path)
    common = Counter(ad.rank for _, _, ad in A.adapter_modules(tr.model)).most_common(1)[0][0]
    assert tr.cfg.network.linear_alpha == pytest.approx(0.25 * math.sqrt(common))   # rsLoRA's alpha, same scale


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_other_kinds_continue_as_their_kind(tmp_path, kind):
    path = _first(tmp_path, f"first_{kind}", steps=3, type=kind, **({"linear": 2} if kind == "lokr" else {}))
    tr = Trainer(_on(tmp_path, f"second_{kind}", path), verbose=False).setup()
    assert tr.cfg.network.type == kind
    assert {type(ad).kind for _, _, ad in A.adapter_modules(tr.model)} == {kind}
    names = [n for n, _ in tr.model.named_modules()]
    want = A.formats.load(path, names, name_map=tr.name_map)[0]
    got = A.adapter_state(tr.model)
    assert set(got) == set(want)
    for m in want:
        for g, w in zip(got[m], want[m]):
            for k in w.tensors:
                np.testing.assert_allclose(g.tensors[k], w.tensors[k], rtol=1e-6, err_msg=f"{m} {k}")
    assert np.isfinite(tr.train_step()[0])


def test_given_targets_add_fresh_layers_beside_the_files(tmp_path):
    path = _first(tmp_path, "attn", target="attention")
    tr = Trainer(_on(tmp_path, "wider", path, target="all_linear"), verbose=False).setup()
    file_mods = set(_file_modules(tr, path))
    adapted = A.adapter_modules(tr.model)
    fresh = [(m, ad) for m, _, ad in adapted if m not in file_mods]
    assert fresh and file_mods <= {m for m, _, _ in adapted}
    assert all(np.abs(ad.lora_B.detach().numpy()).max() == 0 for _, ad in fresh)      # B = 0: the file's function
    assert {ad.rank for _, ad in fresh} == {4} and {ad.scale for _, ad in fresh} == {0.5}   # at the file's rank
    state = {m: p for m, p in A.adapter_state(tr.model).items() if m in file_mods}
    want = _deltas(_file_modules(tr, path), tr.model)
    for k, d in _deltas(state, tr.model).items():
        np.testing.assert_allclose(d, want[k], rtol=1e-6, atol=1e-9)


def test_a_resumed_run_takes_its_adapters_from_the_checkpoint(tmp_path):
    path = _first(tmp_path)
    tr = Trainer(_on(tmp_path, "resume", path, steps=6), verbose=False).setup()
    for _ in range(3):
        tr.train_step()
    tr.save_checkpoint()
    want = [p.detach().numpy().copy() for p in tr.params]
    again = Trainer(_on(tmp_path, "resume", path, steps=6), verbose=False).setup()
    assert again.resumed_from and again.step == 3
    for a, b in zip(again.params, want):
        np.testing.assert_array_equal(a.detach().numpy(), b)


@pytest.mark.parametrize("network, words", [
    ({"linear": 8}, "network.linear 8: the file's adapter on"),
    ({"type": "dora"}, "network.type dora but the file holds lora adapters"),
    ({"linear_alpha": 4}, "network.linear_alpha 4: gives the adapter on"),
    ({"target": "attention"}, "outside network.target 'attention'"),
    ({"network_kwargs": {"only_if_contains": ["double_blocks"]}}, "filters pick among network.target's layers"),
])
def test_settings_that_contradict_the_file_are_errors(tmp_path, network, words):
    path = _first(tmp_path)
    with pytest.raises(ConfigError, match="network.pretrained_lora_path") as e:
        Trainer(_on(tmp_path, "bad", path, **network), verbose=False).setup()
    assert words in str(e.value)


def test_settings_that_agree_with_the_file_are_accepted(tmp_path):
    path = _first(tmp_path)
    tr = Trainer(_on(tmp_path, "agree", path, type="locon", linear=4, linear_alpha=2), verbose=False).setup()
    _assert_same_adapters(tr, path)


def _write(path, tensors, metadata=None):
    io.save_file(tensors, str(path), metadata=metadata)
    return str(path)


def test_bad_files_are_refused_naming_the_file_before_anything_is_built(tmp_path, flux_file):
    good = io.load_file(_first(tmp_path))
    key = next(k for k in good if k.endswith("lora_down.weight"))
    cases = {
        "nan": ({**{k: v.numpy() for k, v in good.items()},
                 key: np.full(good[key].shape, np.nan, np.float32)}, "values are not finite"),
        "te": ({**{k: v.numpy() for k, v in good.items()},
                "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight":
                    np.zeros((4, 8), np.float32),
                "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight":
                    np.zeros((8, 4), np.float32)}, "holds text-encoder adapters"),
        "size": ({key: np.zeros((4, good[key].shape[1] + 1), np.float32),
                  key.replace("down", "up"): np.zeros((good[key.replace("down", "up")].shape[0], 4), np.float32)},
                 "a LoRA for another model size"),
    }
    for name, (tensors, words) in cases.items():
        path = _write(tmp_path / f"{name}.safetensors", tensors)
        tr = Trainer(_on(tmp_path, name, path), verbose=False)
        with pytest.raises(ConfigError, match="network.pretrained_lora_path") as e:
            tr.setup()
        assert words in str(e.value) and path in str(e.value), name
        assert getattr(tr, "model", None) is None, name                  # refused before the model was built
    with pytest.raises(ConfigError, match="not a LoRA file"):
        Trainer(_on(tmp_path, "model", flux_file), verbose=False).setup()


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="network.pretrained_lora_path: no such file"):
        _on(tmp_path, "missing", str(tmp_path / "nope.safetensors"))
    path = _first(tmp_path)
    with pytest.raises(ConfigError, match="bake the LoRA into the model first"):
        tiny_config(tmp_path, "full", drop=NETWORK[1:], network={"type": "full", "pretrained_lora_path": path})


def test_kohya_name_and_the_command_line_flag(tmp_path):
    path = _first(tmp_path)
    alias = tiny_config(tmp_path, "alias", drop=NETWORK, network={"network_weights": path})
    assert alias.network.pretrained_lora_path == path
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"name": "cli", "training_folder": str(tmp_path), "device": "cpu",
                                    "synthetic": {"num_samples": 8, "height": 32, "width": 32, "text_length": 8},
                                    "model": {"size": "flux-tiny", "dtype": "fp32"}}))
    got, _, _ = train_command.build_config(train_command.parser().parse_args(
        ["--config", str(conf), "--network-weights", path]))
    assert got.network.pretrained_lora_path == path and "network.pretrained_lora_path" in got.given


def test_a_kohya_files_block_diagonal_qkv_is_split_back_into_its_row_adapters(tmp_path):
    """kohya files hold Flux's separate to_q / to_k / to_v adapters as one block-diagonal qkv entry; a run on such a
    file continues them as they were trained (each at its rank), while kohya's own dense fused-qkv LoRA stays one
    adapter."""
    from flame_models.training.pretrained_lora import unjoin_rows
    path, state = _handmade(tmp_path, ranks=(3,))
    probe = Trainer(tiny_config(tmp_path, "probe2"), verbose=False).setup()
    out = {k: probe.model.get_submodule(k).weight.shape[0] for k in state}
    joined = {m: [A.formats.join_block_diagonal(parts, out[m], m)] if parts[0].rows is not None else parts
              for m, parts in state.items()}
    assert any(p.rank == 9 for parts in joined.values() for p in parts)        # q, k, v at rank 3 each
    split = unjoin_rows(joined, probe.name_map)
    assert {m: [(p.rows, p.rank) for p in parts] for m, parts in split.items()} == \
        {m: [(p.rows, p.rank) for p in parts] for m, parts in state.items()}
    dense = {m: [A.AdapterPart("lora", {**p.tensors, "lora_up.weight": p.tensors["lora_up.weight"] + 0.01},
                               p.alpha)] for m, parts in joined.items() for p in parts if p.rank == 9}
    assert {m: [(p.rows, p.rank) for p in parts] for m, parts in unjoin_rows(dense, probe.name_map).items()} == \
        {m: [(None, 9)] for m in dense}
    # through a file: the run's adapters are the row ones, of rank 3
    kohya = str(tmp_path / "kohya.safetensors")
    A.formats.save(kohya, state, "kohya", out_features=out)
    tr = Trainer(_on(tmp_path, "kohya", kohya), verbose=False).setup()
    assert {ad.rank for _, _, ad in A.adapter_modules(tr.model)} == {3} and tr.cfg.network.linear == 3
    _assert_same_adapters(tr, kohya)


def test_an_sdxl_locon_file_brings_its_convolution_adapters(tmp_path, images, sdxl_model):
    """A LoCon file (kohya's conv_dim): its convolutions' adapters load at their own rank and scale
    (network.conv / conv_alpha settled from them); network.conv given and different is an error."""
    first = sdxl_config(tmp_path, "locon", sdxl_model, images, steps=3,
                        network={"conv": 2, "conv_alpha": 1, "target": "attention"})
    path = Trainer(first, verbose=False).train()["lora"]
    tr = Trainer(sdxl_config(tmp_path, "locon_on", sdxl_model, images, steps=3, drop=NETWORK,
                             network={"pretrained_lora_path": path}), verbose=False).setup()
    n = tr.cfg.network
    assert (n.conv, n.conv_alpha) == (2, 1.0)
    convs = [ad for _, _, ad in A.adapter_modules(tr.model) if isinstance(ad, A.LoRAConv2d)]
    # the 3x3 convolutions at the conv rank, the 1x1 shortcuts (kohya's set) at the linear rank, as first trained
    assert {(ad.rank, ad.scale) for ad in convs} == {(2, 0.5), (4, 1.0)}
    assert (n.linear, n.linear_alpha) == (4, 4.0)
    _assert_same_adapters(tr, path)
    with pytest.raises(ConfigError, match="network.conv 4: the file's adapter on"):
        Trainer(sdxl_config(tmp_path, "locon_bad", sdxl_model, images, steps=3, drop=NETWORK,
                            network={"pretrained_lora_path": path, "conv": 4}), verbose=False).setup()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_fp8_stored_blocks_train_on_from_the_file(tmp_path, kind):
    """model.quantize (the blocks' Linears stored in fp8): the file's adapters go on top as on a bf16 base (DoRA's
    magnitudes against the dequantised rows)."""
    path = _first(tmp_path, f"first_{kind}", type=kind)
    c = _on(tmp_path, f"fp8_{kind}", path, steps=4)
    c.model.quantize = True
    tr = Trainer(c, verbose=False).setup()
    _assert_same_adapters(tr, path)
    assert np.isfinite(tr.train()["losses"]).all()


@pytest.mark.gpu
@pytest.mark.gpu_exclusive   # a max_gpu_memory budget: other processes' memory counts against it
def test_on_cuda_streamed_and_graphed_the_file_trains_on_as_resident(tmp_path):
    """On cuda in bf16 with CUDA graphs: the file's adapters on resident blocks and on blocks streamed under
    max_gpu_memory give the same losses."""
    path = _first(tmp_path)
    losses = {}
    for budget in (None, "8GiB"):
        c = _on(tmp_path, f"cuda{budget}", path, steps=6)
        c.device, c.train.dtype, c.model.dtype, c.max_gpu_memory = "cuda", "bf16", "bf16", budget
        tr = Trainer(c, verbose=False).setup()
        _assert_same_adapters(tr, path)
        losses[budget] = np.array(tr.train()["losses"])
        assert np.isfinite(losses[budget]).all()
        assert tr.graphed is not None and tr.graphed.graph is not None, tr.graphed.why    # it captured
    np.testing.assert_allclose(losses["8GiB"], losses[None], rtol=2e-2)


@pytest.mark.parametrize("case", ["alpha", "patterns", "rslora", "dora"])
def test_diffusers_written_loras_start_the_run_as_diffusers_applies_them(tmp_path, device, case):
    """Golden check against the real implementation: LoRAs written by diffusers + PEFT (FluxPipeline.
    save_lora_weights with their LoraConfig -- alpha != r, per-module rank / alpha patterns, rsLoRA, DoRA; the
    fixtures of tests/adapters/test_lora_interop.py, a tiny FluxTransformer2DModel whose unpacked 16-channel input
    the trainer's batches do not fit, so no step is taken) as network.pretrained_lora_path: the trainer's model
    before any step gives diffusers' output for that LoRA."""
    import json
    import pathlib

    from safetensors import safe_open

    import flame_core as flame
    from flame_models.flux import flux_params_from_config, load_flux
    fix = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "lora"

    def read(name):
        with safe_open(str(fix / name), "np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    params = flux_params_from_config(json.loads((fix / "flux_config.json").read_text()))
    model = load_flux(fix / "flux_base.safetensors", dtype=flame.float32, device=device, params=params)
    inputs, outputs = read("inputs.safetensors"), read("outputs.safetensors")
    c = _on(tmp_path, case, str(fix / f"{case}.safetensors"), steps=3)
    c.device = device
    tr = Trainer(c, model=model, verbose=False).setup()
    assert tr.cfg.network.type == ("dora" if case == "dora" else "lora")
    tr.model.eval()
    t = {k: flame.tensor(v, device=device) for k, v in inputs.items()}
    with flame.no_grad():
        out = tr.model(img=t["hidden_states"], img_ids=t["img_ids"], txt=t["encoder_hidden_states"],
                       txt_ids=t["txt_ids"], timesteps=t["timestep"], y=t["pooled_projections"],
                       guidance=t["guidance"]).numpy()
    ref = outputs[case]
    assert np.abs(ref - outputs["base"]).max() > 1e-2                      # the LoRA matters
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5 * np.abs(ref).max())
