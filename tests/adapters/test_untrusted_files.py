"""LoRA files are untrusted: crafted PEFT patterns cannot hang the loader, non-finite values and malformed shapes are
refused with an error naming the file and the key (never a traceback, never applied silently)."""
import json
import random
import re
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import flame_nn.adapters as A
from flame_nn.adapters import formats as F
from flame_nn.adapters.patterns import PatternError, SuffixPattern

MODULES = ["qkv", "proj", "out"]          # the tiny model's (adapter_helpers.Tiny): qkv 12 -> 24, proj 24 -> 12
KEY = "lora_unet_qkv"


def _kohya(down=None, up=None, alpha=None, rank=2):
    rng = np.random.default_rng(0)
    sd = {f"{KEY}.lora_down.weight": rng.standard_normal((rank, 12)).astype(np.float32) if down is None else down,
          f"{KEY}.lora_up.weight": rng.standard_normal((24, rank)).astype(np.float32) if up is None else up}
    if alpha is not None:
        sd[f"{KEY}.alpha"] = np.asarray(alpha, dtype=np.float32)
    return sd


def _peft(module="qkv"):
    rng = np.random.default_rng(1)
    return {f"transformer.{module}.lora_A.weight": rng.standard_normal((2, 12)).astype(np.float32),
            f"transformer.{module}.lora_B.weight": rng.standard_normal((24, 2)).astype(np.float32)}


def _config(**fields):
    return {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in {"r": 2, "lora_alpha": 4,
                                                                                    **fields}.items()})}


def _write(tmp_path, sd, metadata=None, name="lora.safetensors"):
    path = tmp_path / name
    save_file(sd, str(path), metadata=metadata)
    return str(path)


def _refused(path, *needles, modules=MODULES):
    with pytest.raises(A.AdapterFormatError) as e:
        F.load(path, modules)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


# ----------------------------------------------------------------------------- PEFT patterns
def test_a_catastrophic_pattern_returns_within_a_second(tmp_path):
    """(a+)+$ against a long name backtracks for ever in Python's re; the loader must return (in a subprocess, so
    that a hang is a failure, not a stuck test run)."""
    name = "blocks." + "a" * 400 + "!"
    sd = {f"transformer.{name}.lora_A.weight": np.ones((2, 12), np.float32),
          f"transformer.{name}.lora_B.weight": np.ones((24, 2), np.float32)}
    path = _write(tmp_path, sd, _config(alpha_pattern={"(a+)+$": 3, "(x|xx)+y": 1}, rank_pattern={"(a*)*b": 5}))
    code = textwrap.dedent(f"""
        import time
        from flame_nn.adapters import formats as F
        t = time.perf_counter()
        modules, _ = F.load({path!r}, [{name!r}])
        print(time.perf_counter() - t, modules[{name!r}][0].alpha)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a LoRA file with the pattern (a+)+$ did not return in 120 s")
    seconds, alpha = out.stdout.split()
    assert float(seconds) < 1.0
    assert float(alpha) == 4.0          # no pattern matches the name: lora_alpha


@pytest.mark.parametrize("pattern, reason", [
    ("(", "not a valid regular expression"),
    (r"(a)\1", "backreferences"),
    ("(?=a)a", "lookarounds"),
    ("(?<!b)a", "lookarounds"),
    ("(?i)qkv", "flags"),
    ("a{100000}", "repeat count"),
    ("((?:){999}){999}", "too complex"),
    pytest.param("q" * 600, "600 characters", id="too-long"),
])
def test_unsafe_or_invalid_patterns_are_refused_naming_them(tmp_path, pattern, reason):
    path = _write(tmp_path, _peft(), _config(rank_pattern={pattern: 2}))
    _refused(path, "rank_pattern pattern", repr(pattern[:80]), reason)


def test_pattern_values_and_config_numbers_are_checked(tmp_path):
    _refused(_write(tmp_path, _peft(), _config(alpha_pattern={"qkv": "big"})), "alpha_pattern['qkv']", "'big'")
    _refused(_write(tmp_path, _peft(), _config(rank_pattern={"qkv": 0})), "rank_pattern['qkv']", "positive integer")
    _refused(_write(tmp_path, _peft(), _config(rank_pattern=["qkv"])), "rank_pattern is list")
    _refused(_write(tmp_path, _peft(), _config(r=2.5)), "r: a rank is a positive integer")


def test_patterns_match_as_peft_does():
    """On patterns Python's re handles quickly, the bounded matcher agrees with PEFT's re.match(rf"(.*\\.)?({k})$")."""
    rnd = random.Random(0)
    names = ["to_q", "attn.to_q", "transformer_blocks.3.attn.to_q", "blocks.01.ff", "", "a.b.c", "proj_out",
             "single_transformer_blocks.10.proj_mlp"]
    names += ["".join(rnd.choice("abq._0x1") for _ in range(rnd.randint(0, 8))) for _ in range(150)]
    keys = ["to_q", "attn.to_q", r"transformer_blocks\.\d+\.attn\.to_q", ".*to_[qk]", "(to_q|to_k)", r"^blocks\..*",
            "a{2,3}", "(ab)*c?", r"[^.]+\.ff", r"\w+_\d*", "(?:proj|attn)(_out)?", ".*", "", r"\Ablocks", r"q\Z",
            "(x$|y)", "proj_mlp"]
    atoms = ["a", "b", ".", r"\.", "q", "[ab]", "[^a]", r"\d", "(a|b)", "(ab)", "(a|.b)"]
    quants = ["", "", "*", "+", "?", "{1,2}", "{2}", "*?"]
    keys += ["".join(rnd.choice(atoms) + rnd.choice(quants) for _ in range(rnd.randint(1, 4))) for _ in range(300)]
    for key in keys:
        m = SuffixPattern(key)
        for name in names:
            assert m.matches(name) == (re.match(rf"(.*\.)?({key})$", name) is not None), (key, name)


def test_matching_is_linear_in_the_name():
    t = time.perf_counter()
    for key in ["(a+)+$", "(a|aa)*b", "(.*a){12}x", "(a*)*(b*)*(a|b)*c"]:
        assert not SuffixPattern(key).matches("a" * 1000 + "!")
    assert time.perf_counter() - t < 1.0
    with pytest.raises(PatternError, match="2000 characters"):
        SuffixPattern("(a+)+").matches("a" * 2000)


def test_the_patterns_of_one_file_share_a_bound(tmp_path):
    """A file's patterns together may visit a bounded number of automaton states: many costly patterns are refused,
    they do not add up to minutes."""
    pats = {f".*a.{{0,150}}c{i}": 3 for i in range(40)}     # a DFA state per position: every step is new work
    rnd = random.Random(0)
    names = [f"m{i}." + "".join(rnd.choice("ab") for _ in range(400)) for i in range(60)]
    sd = {}
    for n in names:
        sd[f"transformer.{n}.lora_A.weight"] = np.ones((2, 12), np.float32)
        sd[f"transformer.{n}.lora_B.weight"] = np.ones((24, 2), np.float32)
    t = time.perf_counter()
    _refused(_write(tmp_path, sd, _config(alpha_pattern=pats)), "automaton states", modules=names)
    assert time.perf_counter() - t < 20


def test_patterns_are_only_matched_against_the_models_modules(tmp_path):
    """A file's adapters on names the model does not have are refused before any pattern runs on them."""
    path = _write(tmp_path, _peft("nothere"), _config(alpha_pattern={"(a+)+$": 3}))
    _refused(path, "name no module of the model", "transformer.nothere")


# ----------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_non_finite_weights_are_refused_naming_the_key(tmp_path, dtype):
    up = np.ones((24, 2), np.float32)
    up[3, 1] = np.nan
    up[5, 0] = np.inf
    path = _write(tmp_path, {k: v.astype(dtype) for k, v in _kohya(up=up).items()})
    _refused(path, f"{KEY}.lora_up.weight", "2 of 48 values are not finite")
    sd = _peft()
    sd["transformer.qkv.lora_A.weight"][0, 0] = -np.inf
    _refused(_write(tmp_path, sd), "transformer.qkv.lora_A.weight", "1 of 24 values are not finite")


def test_non_finite_alphas_are_refused(tmp_path):
    _refused(_write(tmp_path, _kohya(alpha=np.nan)), f"{KEY}.alpha", "not a finite number")
    _refused(_write(tmp_path, _kohya(alpha=[np.inf])), f"{KEY}.alpha", "not a finite number")
    meta = {"lora_adapter_metadata": '{"transformer.r": 2, "transformer.lora_alpha": Infinity}'}
    _refused(_write(tmp_path, _peft(), meta), "lora_alpha", "finite number")
    meta = {"lora_adapter_metadata": '{"transformer.r": 2, "transformer.lora_alpha": 2, '
                                     '"transformer.alpha_pattern": {"qkv": NaN}}'}
    _refused(_write(tmp_path, _peft(), meta), "alpha_pattern['qkv']", "nan")


def test_a_nan_lora_is_not_loaded_into_a_model(tiny, tmp_path):
    up = np.full((24, 2), np.nan, np.float32)
    path = _write(tmp_path, _kohya(up=up))
    with pytest.raises(A.AdapterFormatError, match=re.escape(f"{path}: {KEY}.lora_up.weight")):
        A.load_adapters(tiny, path)
    assert A.adapter_names(tiny) == []


# ----------------------------------------------------------------------------- alpha shapes (kohya / ComfyUI)
@pytest.mark.parametrize("alpha", [2.0, [2.0], [[2.0]]])
def test_a_one_element_alpha_is_read_as_comfyui_does(tmp_path, alpha):
    """kohya writes a 0-d alpha; some tools write [1]. ComfyUI reads `alpha.item()`: any one-element shape."""
    modules, _ = F.load(_write(tmp_path, _kohya(alpha=alpha)), MODULES)
    assert modules["qkv"][0].alpha == 2.0 and modules["qkv"][0].scale == 1.0


def test_an_alpha_of_several_values_is_refused(tmp_path):
    _refused(_write(tmp_path, _kohya(alpha=[2.0, 3.0])), f"{KEY}.alpha", "alpha has shape (2,); one value expected")


# ----------------------------------------------------------------------------- malformed shapes
def test_malformed_shapes_are_clean_errors(tmp_path):
    f32 = np.float32
    cases = [
        (_kohya(down=np.ones(12, f32)), [KEY, "lora_down.weight (12,)", "do not form a LoRA"]),
        (_kohya(down=np.ones((0, 12), f32), up=np.ones((24, 0), f32), alpha=1.0), ["lora_down.weight", "rank 0"]),
        (_kohya(up=np.ones((24, 3), f32)), ["lora_up.weight (24, 3) and lora_down.weight (2, 12)",
                                            "do not share a rank"]),
        (_kohya(down=np.ones((2, 12), np.int32)), ["lora_down.weight: dtype int32"]),
        ({**_kohya(), f"{KEY}.dora_scale": np.ones((1, 12), f32)}, [f"{KEY}.dora_scale: shape (1, 12)"]),
        ({f"{KEY}.hada_w1_a": np.ones((24, 2), f32), f"{KEY}.hada_w1_b": np.ones((2, 12), f32),
          f"{KEY}.hada_w2_a": np.ones((24, 3), f32), f"{KEY}.hada_w2_b": np.ones((3, 12), f32)},
         ["the two Hadamard factors differ"]),
        ({f"{KEY}.lokr_w1": np.ones((4, 4), f32), f"{KEY}.lokr_w2_a": np.ones((6, 2), f32),
          f"{KEY}.lokr_w2_b": np.ones((3, 3), f32)}, ["lokr_w2_a (6, 2) and lokr_w2_b (3, 3) do not share a rank"]),
        ({f"{KEY}.lokr_w1": np.ones((4,), f32), f"{KEY}.lokr_w2": np.ones((6, 3), f32)},
         ["lokr_w1 (4,)", "2-D"]),
    ]
    for sd, needles in cases:
        _refused(_write(tmp_path, sd), *needles)
    sd = _peft()
    sd["transformer.qkv.lora_A.weight"] = np.ones((0, 12), np.float32)
    _refused(_write(tmp_path, sd), "transformer.qkv.lora_A.weight", "empty")
    sd = _peft()
    sd["transformer.qkv.lora_B.weight"] = np.ones((24, 3, 1), np.float32)
    _refused(_write(tmp_path, sd), "transformer.qkv", "lora_A.weight (2, 12) and lora_B.weight (24, 3, 1)")


def test_flame_recorded_alphas_are_checked(tmp_path):
    for alphas, needle in [("{", "is not JSON"), ('{"qkv": [0, 2]}', "not 0"), ('{"qkv": [4, 3]}', "rank 2"),
                           ('{"qkv": "x"}', "entry 'x'")]:
        _refused(_write(tmp_path, _peft(), {"flame.alphas": alphas}), needle)
    modules, _ = F.load(_write(tmp_path, _peft(), {"flame.alphas": '{"qkv": [4, 2]}'}), MODULES)
    assert modules["qkv"][0].alpha == 4
