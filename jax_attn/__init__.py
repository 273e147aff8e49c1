"""Attention variants as Pallas GPU kernels (Triton lowering; on Hopper the softmax forward also
as a Mosaic GPU kernel) for JAX.

Layout everywhere: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (BSHD).
"""
from jax_attn.api import IMPLEMENTATIONS, default_implementation, flash_attention
from jax_attn.device import DeviceInfo, device_info, recommended_dtype
from jax_attn.layers import EncoderBlock, MultiHeadSelfAttention, attention_fn, make_attention_fn
from jax_attn.mosaic_gpu import MosaicBlocks
from jax_attn.pallas_triton import BlockSizes, default_block_sizes
from jax_attn.positions import sinusoidal_positions
from jax_attn.rope import Rope, apply_rope
from jax_attn.spec import AttentionSpec
from jax_attn.stick_breaking import stick_breaking_attention, stick_breaking_reference
from jax_attn.stick_breaking_pallas import StickBreakingBlocks
from jax_attn.xla import attention_reference

__all__ = [
    "AttentionSpec", "BlockSizes", "DeviceInfo", "IMPLEMENTATIONS", "attention_reference",
    "default_block_sizes", "default_implementation", "device_info", "flash_attention",
    "MosaicBlocks", "recommended_dtype", "Rope", "apply_rope",
    "EncoderBlock", "MultiHeadSelfAttention", "attention_fn", "make_attention_fn", "sinusoidal_positions",
    "StickBreakingBlocks", "stick_breaking_attention", "stick_breaking_reference",
]
