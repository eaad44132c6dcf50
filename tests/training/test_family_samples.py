"""The families' check of one cached sample's shapes (check_sample) and the shapes of their synthetic conditioning:
the pooled-vector families (Flux: vec_in_dim) and the masked-text ones (Chroma, Qwen-Image: a prompt_mask per token),
both from family_base."""
import pytest

from flame_models.training.family import get_family

MASKED = [("chroma", "chroma-tiny", "context_in_dim"), ("qwen_image", "qwen-image-tiny", "joint_attention_dim")]


@pytest.mark.parametrize("name, size, ctx_name", MASKED)
def test_masked_text_families_check_the_mask_against_the_text(name, size, ctx_name):
    fam = get_family(name)
    spec = fam.preset(size)
    ctx = getattr(spec, ctx_name)
    c = fam.latent_channels
    good = {"latents": (c, 8, 8), "prompt_embeds": (12, ctx), "prompt_mask": (12,)}
    assert fam.check_sample(good, spec) is None
    assert fam.check_sample({"prompt_mask": (12,)}, None) is None  # absent keys are not checked
    assert fam.check_sample({**good, "prompt_mask": (11,)}, spec) == \
        "prompt_mask (11,): expected (L,), one entry per prompt_embeds token"
    assert fam.check_sample({**good, "prompt_mask": (12, 1)}, spec).startswith("prompt_mask (12, 1)")
    assert fam.check_sample({**good, "prompt_embeds": (12, ctx + 1)}, spec) == \
        f"prompt_embeds (12, {ctx + 1}): expected (L, {ctx}) for this model"
    assert fam.check_sample({"prompt_embeds": (12,)}, None) == \
        f"prompt_embeds (12,): expected (L, {ctx_name}) for this model"
    assert fam.check_sample({**good, "latents": (c, 7, 8)}, spec) == \
        f"latents ({c}, 7, 8): expected ({c}, h, w) with even h and w"
    assert fam.synthetic_conditioning(spec, 20) == {"prompt_embeds": (20, ctx), "prompt_mask": (20,)}


def test_a_pooled_family_checks_its_pooled_vector():
    fam = get_family("flux")
    spec = fam.preset("flux-tiny")
    ctx, vec = spec.context_in_dim, spec.vec_in_dim
    good = {"latents": (fam.latent_channels, 8, 8), "prompt_embeds": (12, ctx), "pooled_prompt_embeds": (vec,)}
    assert fam.check_sample(good, spec) is None
    assert fam.check_sample({**good, "pooled_prompt_embeds": (vec + 1,)}, spec) == \
        f"pooled_prompt_embeds ({vec + 1},): expected ({vec},) for this model"
    assert fam.synthetic_conditioning(spec, 20) == {"prompt_embeds": (20, ctx), "pooled_prompt_embeds": (vec,)}
