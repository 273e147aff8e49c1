"""The public functions, by kind: single-device attention (`attention`), sequence parallelism
(`sequence_parallel`) and Native Sparse Attention (`nsa`)."""
from jax_attn.api.attention import (dilated_attention, flash_attention, flash_attention_varlen, stick_breaking_attention,
                                    stick_breaking_attention_varlen)
from jax_attn.api.nsa import compress_kv, compression_attention, nsa_attention, select_blocks, selection_attention
from jax_attn.api.sequence_parallel import (context_parallel_attention, context_parallel_dilated_attention,
                                            default_strategy, ring_attention, ring_dilated_attention)

__all__ = ["compress_kv", "compression_attention", "context_parallel_attention", "context_parallel_dilated_attention",
           "default_strategy", "dilated_attention", "flash_attention", "flash_attention_varlen", "nsa_attention",
           "ring_attention", "ring_dilated_attention", "select_blocks", "selection_attention",
           "stick_breaking_attention", "stick_breaking_attention_varlen"]
