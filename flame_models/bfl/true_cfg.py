"""True classifier-free guidance for a Flux transformer, as diffusers' FluxPipeline runs it with `true_cfg_scale` > 1
and a negative prompt: each call also runs the negative prompt's T5 states and CLIP pooled vector -- here in the same
batch, diffusers' two calls in one -- with the same image tokens, timestep and embedded guidance, and returns

    v = v_neg + scale · (v_pos - v_neg)

Called as the Flux it wraps (bfl/sampling.denoise's velocity), so it runs inside the samplers' CUDA step graphs and
under block streaming (the wrapped model's streamer is found through it); each step costs two images' forward.
"""
import flame_core as flame
import flame_nn

from ..conditioning import prompt_rows


class TrueCFG(flame_nn.Module):
    """`model` (a Flux) with the negative conditioning neg_txt (B, L, C) / neg_y (B, vec) -- the rows of the images
    the sampler runs -- and the guidance `scale` (> 1)."""

    def __init__(self, model, neg_txt, neg_y, scale):
        super().__init__()
        self.model, self.params = model, model.params
        self.neg_txt, self.neg_y, self.scale = neg_txt, neg_y, float(scale)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y=None, guidance=None):
        def two(a, b):
            return flame.cat([a, b], dim=0)
        v = self.model(img=two(img, img), img_ids=two(img_ids, img_ids), txt=two(txt, self.neg_txt),
                       txt_ids=two(txt_ids, txt_ids), timesteps=two(timesteps, timesteps), y=two(y, self.neg_y),
                       guidance=None if guidance is None else two(guidance, guidance))
        B = img.shape[0]
        v_pos, v_neg = v[:B], v[B:]
        return v_neg + self.scale * (v_pos - v_neg)


def with_true_cfg(model, neg, rows, txt, scale, device, dtype):
    """`model` wrapped in TrueCFG when `scale` > 1 and `neg` is given ({"prompt_embeds", "pooled_prompt_embeds"}: one
    row for every image, or one per prompt, picked by `rows`), else `model`; a ValueError when the negative prompt's
    T5 length differs from the prompt's (`txt`)."""
    if scale is None or float(scale) <= 1.0 or neg is None:
        return model
    n = neg["pooled_prompt_embeds"].shape[0]
    neg_txt, neg_y = prompt_rows(neg, [r if n > 1 else 0 for r in rows], device, dtype)
    if neg_txt.shape[1] != txt.shape[1]:
        raise ValueError(f"the negative prompt has {neg_txt.shape[1]} T5 tokens, the prompt {txt.shape[1]}")
    return TrueCFG(model, neg_txt, neg_y, scale)
