"""`structure_only()`: text encoders built for their layers' names and shapes only, no tensor read or drawn.

Inside the block, load_clip / load_t5 stop once the model is built from the checkpoint's config under
`flame_nn.empty_init` on the cpu and its keys are checked against the file's headers (no weight read, no fp8
storage, no streaming), and the families' random encoders (training/family_parts.py) skip their draws. A family's
`load_text_encoders` run inside it gives the encoders it would load, empty: what a LoRA file's text-encoder part is
checked against (names, shapes, kinds) before any image is encoded or any weight read (training/base_loras.py).

    with structure_only():
        enc = family.load_text_encoders(model_cfg, "cpu")      # tokenizers as usual, models without storage
"""
import threading
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def structure_only():
    prev = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = prev


def is_structure_only():
    """Whether this thread is inside a structure_only() block."""
    return getattr(_local, "on", False)
