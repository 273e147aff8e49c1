"""Attention variants as Pallas GPU kernels (Triton lowering; Mosaic GPU on Hopper) for JAX.

Layout everywhere: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (BSHD). Implementations ("triton",
"mosaic", "xla") and the rule for implementation=None live in `jax_attn.registry`; tile configs
(`BlockSizes`, `MosaicBlockSizes`, `StickBreakingBlockSizes`, `NSABlockSizes`) are passed as `config=`.
Native Sparse Attention: `nsa_attention` and its parts `compress_kv`, `compression_attention`,
`select_blocks`, `selection_attention`. Sequence parallelism over a mesh axis: `ring_attention` /
`ring_dilated_attention` (inside `jax.shard_map`; orderings within each shard) and
`context_parallel_attention` / `context_parallel_dilated_attention` (global arrays);
zigzag helpers `to_zigzag`, `from_zigzag`.
"""
from jax_attn.api import (compress_kv, compression_attention, context_parallel_attention,
                          context_parallel_dilated_attention, default_strategy,
                          dilated_attention, flash_attention, flash_attention_varlen, nsa_attention, ring_attention,
                          ring_dilated_attention, select_blocks, selection_attention, stick_breaking_attention,
                          stick_breaking_attention_varlen)
from jax_attn.ops.nsa.triton import NSABlockSizes
from jax_attn.ops.ring.layout import from_layout, from_zigzag, layout_positions, to_layout, to_zigzag
from jax_attn.device import DeviceInfo, device_info, recommended_dtype
from jax_attn.nn.layers import EncoderBlock, MultiHeadSelfAttention, attention_fn, make_attention_fn
from jax_attn.nn.layers import DilatedAttention, HilbertDilatedAttention, MultiheadDilatedAttention
from jax_attn.nn.layers import CompressMLP, NativeSparseAttention
from jax_attn.nn.positions import sinusoidal_positions
from jax_attn.ops.common.rope import Rope, apply_rope
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.softmax.mosaic import MosaicBlockSizes, default_mosaic_block_sizes
from jax_attn.ops.softmax.reference import attention_reference
from jax_attn.ops.softmax.triton import BlockSizes, default_block_sizes
from jax_attn.ops.stick_breaking.reference import stick_breaking_reference
from jax_attn.ops.stick_breaking.triton import StickBreakingBlockSizes, default_stick_breaking_block_sizes
from jax_attn.registry import IMPLEMENTATIONS, UnknownImplementationError, default_implementation
from jax_attn import orderings  # space-filling-curve permutations
from jax_attn.autotune import CacheError, TuneResult, autotune, benchmark_backends

__all__ = [
    "AttentionSpec", "BlockSizes", "CacheError", "TuneResult", "autotune", "benchmark_backends", "DeviceInfo", "dilated_attention", "IMPLEMENTATIONS", "attention_reference",
    "default_block_sizes", "default_implementation", "device_info", "flash_attention", "flash_attention_varlen",
    "MosaicBlockSizes", "default_mosaic_block_sizes", "recommended_dtype", "Rope", "apply_rope",
    "EncoderBlock", "MultiHeadSelfAttention", "attention_fn", "make_attention_fn", "sinusoidal_positions",
    "DilatedAttention", "MultiheadDilatedAttention", "HilbertDilatedAttention", "CompressMLP", "NativeSparseAttention",
    "StickBreakingBlockSizes", "default_stick_breaking_block_sizes", "stick_breaking_attention",
    "stick_breaking_attention_varlen",
    "stick_breaking_reference", "UnknownImplementationError", "orderings",
    "ring_attention", "ring_dilated_attention", "context_parallel_attention", "context_parallel_dilated_attention",
    "default_strategy", "to_zigzag",
    "from_zigzag", "to_layout", "from_layout", "layout_positions",
    "compress_kv", "compression_attention", "nsa_attention", "NSABlockSizes", "select_blocks", "selection_attention",
]
