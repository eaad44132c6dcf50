"""FLAME's Qwen-Image LoRA files through diffusers' loader, and the Qwen2 tokenizer and prompt template against
transformers / diffusers: the fixtures qwen_image_lora_io.safetensors and qwen_image_tokenizer_io.safetensors that
tests/fixtures/make_qwen_image_fixtures.py writes (the `lora` and `tokenizer` parts), beside the others in
tests/fixtures/qwen_image/."""
import json
import os

import numpy as np
import pytest
from test_qwen_image_parity import HERE, RTOL, _forward, _read, _rel, fixture  # noqa: F401

import flame_core as flame


# ----------------------------------------------------------------------------- LoRA files in diffusers
@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_flames_lora_files_give_diffusers_output(fixture, fmt):  # noqa: F811
    """The files of tests/fixtures/qwen_image_lora/ (written by FLAME) as diffusers loaded them, against FLAME with
    the same files."""
    from flame_nn.adapters import load_adapters, remove_adapters
    model, a, meta = fixture
    lora_io, lmeta = _read("qwen_image_lora_io.safetensors")
    path = os.path.join(os.path.dirname(HERE), "qwen_image_lora", f"qwen_image_lora_{fmt}.safetensors")
    load_adapters(model, path, name=fmt)
    try:
        with flame.no_grad():
            out = _forward(model, a, meta, None)[0].numpy()
    finally:
        remove_adapters(model, fmt)
    want = lora_io[f"out_{fmt}"]
    assert _rel(want, a["out_nomask"]) > 1e-3                  # the file changes diffusers' output
    assert _rel(out, want) <= RTOL, (_rel(out, want), lmeta.get(f"{fmt}_keys"))


# ----------------------------------------------------------------------------- prompt template and tokenizer
def test_the_prompt_template_and_tokenizer_match_the_pipelines():
    from flame_models.qwen_image.conditioning import DROP_TOKENS, PROMPT_TEMPLATE, TOKENIZER_MAX_LENGTH
    from flame_models.tokenization.qwen2 import Qwen2Tokenizer
    a, meta = _read("qwen_image_tokenizer_io.safetensors")
    assert meta["template"] == PROMPT_TEMPLATE and int(meta["drop"]) == DROP_TOKENS
    assert int(meta["max_length"]) == TOKENIZER_MAX_LENGTH + DROP_TOKENS and meta["padding_side"] == "right"
    tok = Qwen2Tokenizer.from_folder(os.path.join(os.path.dirname(HERE), "qwen_image_tokenizer"))
    assert tok.pad_token_id == int(meta["pad_token_id"]) and len(tok) == int(meta["vocab"])
    texts = [PROMPT_TEMPLATE.format(p) for p in json.loads(meta["prompts"])]
    ids, mask = tok(texts, max_length=int(meta["max_length"]))
    np.testing.assert_array_equal(ids, a["input_ids"])
    np.testing.assert_array_equal(mask, a["attention_mask"])
    ids, mask = tok(texts, max_length=40)
    np.testing.assert_array_equal(ids, a["short_ids"])
    np.testing.assert_array_equal(mask, a["short_mask"])
