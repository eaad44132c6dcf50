"""The families' attended text prefix (attended_text_length) and their training path on a cut batch: Chroma's T5
(real tokens + the first padding token) and Qwen-Image's valid tokens give the same predictions cut as masked."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.device import default_device
from flame_models.chroma import Chroma
from flame_models.data.text_trim import TextTrim
from flame_models.qwen_image import QwenImageTransformer2DModel
from flame_models.training.family import get_family


def test_chroma_attends_the_real_tokens_and_one_padding_token():
    fam = get_family("chroma")
    assert fam.attended_text_length(np.array([1, 1, 1, 0, 0, 0, 0, 0], np.float32)) == 4
    assert fam.attended_text_length(np.ones(8, np.float32)) == 8
    assert fam.attended_text_length(np.zeros(8, np.float32)) == 8          # no real token: all attended
    assert get_family("flux").attended_text_length(np.ones(8, np.float32)) is None


def test_qwen_image_attends_its_leading_valid_tokens_only():
    fam = get_family("qwen_image")
    assert fam.attended_text_length(np.array([1, 1, 0, 0], np.float32)) == 2
    assert fam.attended_text_length(np.array([1, 0, 1, 0], np.float32)) is None   # a hole: not a prefix
    assert fam.attended_text_length(np.zeros(4, np.float32)) == 4


def _batch(rng, lengths, full, dim):
    return {"latents": rng.normal(size=(len(lengths), 16, 8, 8)).astype(np.float32),
            "prompt_embeds": rng.normal(size=(len(lengths), full, dim)).astype(np.float32),
            "prompt_mask": np.stack([(np.arange(full) < n).astype(np.float32) for n in lengths])}


def _cut(fam, batch):
    trim = TextTrim()
    trim.plan([fam.attended_text_length(m) for m in batch["prompt_mask"]], batch["prompt_mask"].shape[1])
    rows = [trim.apply({k: batch[k][i] for k in ("prompt_embeds", "prompt_mask")})
            for i in range(len(batch["latents"]))]
    return {"latents": batch["latents"], **{k: np.stack([r[k] for r in rows]) for k in rows[0]}}, trim


@pytest.mark.parametrize("arch,lengths,keeps_mask", [("chroma", (3, 5), True), ("chroma", (4, 4), False),
                                                    ("qwen_image", (3, 6), True), ("qwen_image", (5, 5), False)])
def test_a_cut_batch_predicts_as_the_masked_full_one(arch, lengths, keeps_mask):
    fam, dev = get_family(arch), default_device()
    flame.manual_seed(0)
    model = (Chroma("chroma-tiny", device=dev) if arch == "chroma"
             else QwenImageTransformer2DModel("qwen-image-tiny", dtype=flame.float32, device=dev)).eval()
    dim = model.params.context_in_dim if arch == "chroma" else model.params.joint_attention_dim
    rng = np.random.default_rng(1)
    full = _batch(rng, lengths, 12, dim)
    cut, trim = _cut(fam, full)
    assert trim.keep_mask == keeps_mask and ("prompt_mask" in cut) == keeps_mask
    assert cut["prompt_embeds"].shape[1] == max(lengths) + (arch == "chroma")
    t = flame.tensor(np.array([0.3, 0.8], np.float32), device=dev)
    with flame.no_grad():
        outs = []
        for b in (full, cut):
            x0, cond = fam.training_inputs(model, b, dev, None)
            assert ("txt_mask" in cond) == ("prompt_mask" in b)
            outs.append(fam.forward(model, x0, t, cond).numpy())
        x0, cond = fam.training_inputs(model, full, dev, None)
        del cond["txt_mask"]                                              # unmasked: the padding does matter
        plain = fam.forward(model, x0, t, cond).numpy()
    scale = np.abs(outs[0]).max()
    assert np.abs(outs[1] - outs[0]).max() <= 1e-5 * scale
    assert np.abs(plain - outs[0]).max() > 1e-3 * scale
