"""What the text encoder models share: save_pretrained, a `to` that drops stale fused views, dtype / device read
from the token embedding, and the gradient checkpointing switches."""
import flame_nn

from .storage import drop_stale_fusions_


class TextEncoderModel(flame_nn.GradientCheckpointingMixin, flame_nn.Module):
    """Base of CLIPTextModel and T5EncoderModel. A subclass gives `get_input_embeddings()` (the token Embedding, as
    transformers names it) and `checkpointed_blocks()` (its encoder layers)."""

    def get_input_embeddings(self):
        raise NotImplementedError

    def save_pretrained(self, folder, dtype=None):
        """config.json + model.safetensors, readable by load_clip / load_t5 and by transformers (dtype: the floating
        weights written in it; None: their own)."""
        from .saving import save_pretrained
        return save_pretrained(self, folder, dtype)

    def to(self, *args, **kwargs):
        super().to(*args, **kwargs)
        drop_stale_fusions_(self)  # fused views of the old storage would keep it alive
        return self

    @property
    def dtype(self):
        return self.get_input_embeddings().weight.dtype

    @property
    def device(self):
        return self.get_input_embeddings().weight.device
