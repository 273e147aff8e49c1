"""Layers on the attention functions (`layers`: MultiHeadSelfAttention, EncoderBlock, the twins of
jax_attn's) and absolute sinusoidal positions (`positions`)."""
from .layers import EncoderBlock, MultiHeadSelfAttention
from .positions import sinusoidal_positions

__all__ = ["EncoderBlock", "MultiHeadSelfAttention", "sinusoidal_positions"]
