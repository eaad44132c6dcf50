"""ai-toolkit's model.quantize_kwargs: exclusions of modules outside the blocks (what FLAME never quantises) are
accepted, a pattern naming a block Linear -- FLAME's name or diffusers' -- is an error before anything loads, as are
include, other keys and the setting without model.quantize (tiny Flux, cpu)."""
import pytest

from flame_models.training.config import ConfigError
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


def _config(tmp_path, name, kwargs, quantize=True):
    return tiny_config(tmp_path, name, steps=3, model={"quantize": quantize, "quantize_kwargs": kwargs})


def test_ai_toolkits_embedder_exclusion_asks_for_what_flame_does(tmp_path):
    c = _config(tmp_path, "ok", {"exclude": ["*time_text_embed*", "img_in", "*guidance_in*"]})
    tr = Trainer(c, verbose=False).setup()
    assert not hasattr(tr.model.time_in.in_layer, "dequantized_weight")       # (outside the blocks: as it was)
    assert hasattr(tr.model.double_blocks[0].img_attn.qkv, "dequantized_weight")


@pytest.mark.parametrize("pattern, module", [("*attn*", "double_blocks.0.img_attn.qkv"),
                                             ("transformer_blocks.0.ff.*", "transformer_blocks.0.ff.net.0.proj"),
                                             ("single_blocks.1.linear2", "single_blocks.1.linear2")])
def test_a_pattern_naming_a_block_linear_is_an_error_before_anything_loads(tmp_path, pattern, module):
    tr = Trainer(_config(tmp_path, "bad", {"exclude": pattern}), verbose=False)
    with pytest.raises(ConfigError, match=rf"model.quantize_kwargs.exclude: '{pattern.replace('*', '[*]')}' names "
                                          rf"the block Linear {module}, which FLAME stores in fp8"):
        tr.setup()
    assert tr.prepared is None and not hasattr(tr, "model")


@pytest.mark.parametrize("kwargs, quantize, words", [
    ({"include": ["*blocks*"]}, True, r"model.quantize_kwargs.include: not available"),
    ({"exclude": 3}, True, r"model.quantize_kwargs.exclude: a pattern or a list of patterns"),
    ({"exclude": ["img_in"]}, False, r"model.quantize_kwargs: only used with model.quantize: true"),
])
def test_config_mistakes(tmp_path, kwargs, quantize, words):
    with pytest.raises(ConfigError, match=words):
        _config(tmp_path, "x", kwargs, quantize)
