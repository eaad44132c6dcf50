"""Kontext's reference image as transformer input: the size it is resized to (diffusers' PREFERRED_KONTEXT_RESOLUTIONS,
as BFL's), its packed tokens' position ids (1, r, c) -- index 1 on the first RoPE axis, rows and columns from 0, as
FluxKontextPipeline builds them -- and the joint sequence [target tokens | reference tokens]."""
import flame_core as flame

from ..bfl.sampling import image_ids

# (width, height) pairs, as diffusers' FluxKontextPipeline lists them
PREFERRED_KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672))


def kontext_size(width, height, multiple=16):
    """(width, height) a reference image of this size is resized to: the listed resolution whose aspect ratio is
    closest to width / height (the first on a tie, as min() picks it), floored to a multiple of 16."""
    if width <= 0 or height <= 0:
        raise ValueError(f"a reference image needs a positive size, got {width}x{height}")
    ar = width / height
    w, h = min(PREFERRED_KONTEXT_RESOLUTIONS, key=lambda r: abs(ar - r[0] / r[1]))
    return w // multiple * multiple, h // multiple * multiple


def reference_ids(height, width, batch_size=1, *, device=None, dtype=flame.float32):
    """(B, h*w, 3) ids of a reference image's packed tokens: (1, row, col)."""
    ids = image_ids(height, width, batch_size, device=device, dtype=dtype)
    first = flame.ones(*ids.shape[:2], 1, dtype=dtype, device=device)
    return flame.cat([first, ids[..., 1:]], dim=-1)


def with_reference(img, img_ids, ref, ref_ids):
    """The transformer's image input with the reference appended: (B, L_tgt + L_ref, C) tokens and their ids."""
    if ref.shape[0] != img.shape[0] and ref.shape[0] == 1:
        ref = ref.expand(img.shape[0], *ref.shape[1:])
    if ref_ids.shape[0] != img_ids.shape[0] and ref_ids.shape[0] == 1:
        ref_ids = ref_ids.expand(img_ids.shape[0], *ref_ids.shape[1:])
    return flame.cat([img, ref.to(img.dtype)], dim=1), flame.cat([img_ids, ref_ids.to(img_ids.dtype)], dim=1)


def target_velocity(v, n_target):
    """The velocity of the target tokens: the first n_target of the output (the reference's are discarded)."""
    return v[:, :n_target]
