"""Building blocks that several model families share (a family's own blocks stay in its folder): the sinusoidal
timestep embedding, adaLN modulation chunks and the final adaLN layer of the DiTs (layers.py), and their fused ops
-- LayerNorm + modulate, QK RMS-norm (ops.py)."""
from .layers import LastLayer, modulation_chunks, timestep_embedding
from .ops import norm_modulate, qk_norm

__all__ = ["LastLayer", "modulation_chunks", "timestep_embedding", "norm_modulate", "qk_norm"]
