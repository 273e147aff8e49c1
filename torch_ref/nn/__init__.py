"""Layers on the attention functions (`layers`: MultiHeadSelfAttention, EncoderBlock, the twins of
jax_attn's) and absolute sinusoidal positions (`positions`)."""
from .layers import CompressMLP, EncoderBlock, MultiHeadSelfAttention, NativeSparseAttention
from .positions import sinusoidal_positions

__all__ = ["CompressMLP", "EncoderBlock", "MultiHeadSelfAttention", "NativeSparseAttention",
           "sinusoidal_positions"]
