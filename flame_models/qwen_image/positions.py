"""Qwen-Image's RoPE positions (diffusers' QwenEmbedRope with scale_rope=True), as (frame, row, col) ids that
flame_models.bfl.ops.rope_freqs turns into rotations of adjacent pairs -- the same rotation as diffusers' complex
product, axes in the order frame | height | width.

An image of h x w tokens (frames f, index i among a sample's images) is centred: token (t, r, c) has the position
(i + t, r - ceil(h/2), c - ceil(w/2)) (h = 64: rows -32 .. 31; h = 5: rows -3 .. 1). Text token j of the padded text
has (s + j, s + j, s + j) on all three axes, s = max over the images of max(h // 2, w // 2). Tokens are row-major,
as the 2x2 latent packing orders them."""
import flame_core as flame


def image_shapes(img_shapes, batch_size, n_img_tokens):
    """The images of one sample [(frames, rows, cols), ...] from diffusers' `img_shapes`: a list with one entry per
    sample (each a list of (f, h, w) or one (f, h, w)), or one (f, h, w) for every sample. All samples must agree
    (diffusers uses the first sample's for the whole batch) and the tokens must number n_img_tokens."""
    if img_shapes is None:
        raise ValueError("img_shapes is required: [(frames, rows, cols)] of the packed latent grid per sample")
    if _is_shape(img_shapes):
        per_sample = [[tuple(img_shapes)]] * batch_size
    else:
        per_sample = [[tuple(s)] if _is_shape(s) else [tuple(x) for x in s] for s in img_shapes]
    if len(per_sample) != batch_size:
        raise ValueError(f"img_shapes has {len(per_sample)} entries for a batch of {batch_size}")
    first = per_sample[0]
    if any(s != first for s in per_sample):
        raise ValueError(f"img_shapes differ between samples ({per_sample}): Qwen-Image places one set of "
                         f"positions for the whole batch")
    for s in first:
        if len(s) != 3 or not all(isinstance(v, int) and v > 0 for v in s):
            raise ValueError(f"img_shapes entry {s}: expected (frames, rows, cols) of positive ints")
    n = sum(f * h * w for f, h, w in first)
    if n != n_img_tokens:
        raise ValueError(f"img_shapes {first} make {n} image tokens, hidden_states has {n_img_tokens}")
    return first


def _is_shape(s):
    return isinstance(s, (tuple, list)) and len(s) == 3 and all(isinstance(v, int) for v in s)


def text_start(images):
    """s: the first text position, max over the images of max(rows // 2, cols // 2)."""
    return max(max(h // 2, w // 2) for _, h, w in images)


def position_ids(images, n_txt, device=None):
    """(L_txt + L_img, 3) float32 ids of [text, image tokens] for one sample's images [(f, h, w), ...]."""
    s = text_start(images)
    t = flame.arange(s, s + n_txt, dtype=flame.float32, device=device)
    parts = [flame.stack([t, t, t], dim=-1)]
    for idx, (f, h, w) in enumerate(images):
        fr = flame.arange(idx, idx + f, dtype=flame.float32, device=device)
        rows = flame.arange(h, dtype=flame.float32, device=device) - float(h - h // 2)
        cols = flame.arange(w, dtype=flame.float32, device=device) - float(w - w // 2)
        grid = flame.stack([fr[:, None, None].expand(f, h, w), rows[None, :, None].expand(f, h, w),
                            cols[None, None, :].expand(f, h, w)], dim=-1)
        parts.append(grid.reshape(f * h * w, 3))
    return flame.cat(parts, dim=0)
