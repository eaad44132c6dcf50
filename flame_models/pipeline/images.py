"""Decoded images out of a pipeline."""
import numpy as np

import flame_core as flame


def to_pil(images):
    """Images (B, 3, H, W) (a Tensor or NumPy array) in [-1, 1] -> list of RGB PIL images, as diffusers'
    VaeImageProcessor.postprocess: (x / 2 + 0.5) clamped to [0, 1] in the images' dtype, then x * 255 rounded."""
    from PIL import Image
    if isinstance(images, flame.Tensor):
        with flame.no_grad():
            x = (images / 2 + 0.5).clamp(0, 1)
            arr = x.float().cpu().numpy()
    else:
        arr = np.clip(np.asarray(images) / 2 + 0.5, 0, 1).astype(np.float32)
    if arr.ndim != 4 or arr.shape[1] not in (1, 3):
        raise ValueError(f"to_pil expects images (B, 3, H, W), got shape {arr.shape}")
    arr = (arr.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0], mode="L") for a in arr]
    return [Image.fromarray(a, mode="RGB") for a in arr]
