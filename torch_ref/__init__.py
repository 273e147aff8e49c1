"""PyTorch + Triton reference backend of the attention library.

`flash_attention` (Triton kernels or eager PyTorch, see its docstring), `flash_attention_reference`
(the eager reference returning (out, lse)), `stick_breaking_attention` / `stick_breaking_reference` /
`stick_breaking_attention_varlen` (stick-breaking attention, "ExpoSB"; torch_ref.ops.stick_breaking),
`dilated_attention` (LongNet's dilated attention on the softmax kernels; torch_ref.ops.dilated), `Rope` (rotary position
embedding config, fused into the kernels; `torch_ref.ops.common.rope.apply_rope` is the plain
rotation) and `BlockSizes` / `StickBreakingBlockSizes` (the kernels' tile configurations, with the
field names of jax_attn's; `config=` of the public functions), `default_block_sizes` /
`default_stick_breaking_block_sizes`.

Layout (variant first, the mirror of jax_attn): `api.py` (the public functions), `registry.py`
(implementation names, the rule for None, configs), `ops/common/` (validation, rope, the Triton tile toolkit),
`ops/softmax/` and `ops/stick_breaking/` (each: `reference.py` beside `triton.py`), `nn/` (layers,
positions).

Triton is imported lazily: `import torch_ref` does not import it, so TRITON_INTERPRET=1 may still
be set afterwards; the first Triton call (or touching one of the config names above) imports it.
"""
from .api import (compress_kv, compression_attention, dilated_attention, flash_attention, flash_attention_reference,
                  flash_attention_varlen, nsa_attention, select_blocks, selection_attention, stick_breaking_attention,
                  stick_breaking_attention_varlen, stick_breaking_reference)
from .nn.layers import EncoderBlock, MultiHeadSelfAttention
from .nn.layers import DilatedAttention, HilbertDilatedAttention, MultiheadDilatedAttention
from .nn.layers import CompressMLP, NativeSparseAttention
from .nn.positions import sinusoidal_positions
from .ops.common.rope import Rope, apply_rope
from .registry import IMPLEMENTATIONS, UnknownImplementationError, resolve_implementation
from . import orderings  # space-filling-curve permutations
from .autotune import CacheError, TuneResult, autotune, benchmark_backends

__all__ = ["flash_attention", "flash_attention_reference", "flash_attention_varlen", "Rope", "apply_rope",
           "BlockSizes", "default_block_sizes",
           "IMPLEMENTATIONS", "resolve_implementation", "UnknownImplementationError", "EncoderBlock",
           "MultiHeadSelfAttention", "sinusoidal_positions", "stick_breaking_attention", "stick_breaking_reference",
           "stick_breaking_attention_varlen", "DilatedAttention", "MultiheadDilatedAttention", "HilbertDilatedAttention",
           "CompressMLP", "NativeSparseAttention",
           "StickBreakingBlockSizes", "default_stick_breaking_block_sizes", "dilated_attention", "orderings",
           "selection_attention", "compress_kv", "compression_attention", "select_blocks", "nsa_attention",
           "NSABlockSizes", "default_nsa_block_sizes", "CacheError", "TuneResult", "autotune", "benchmark_backends"]


def __getattr__(name):
    if name in ("BlockSizes", "default_block_sizes"):
        from .ops.softmax import triton as softmax_triton
        return getattr(softmax_triton, name)
    if name in ("StickBreakingBlockSizes", "default_stick_breaking_block_sizes"):
        from .ops.stick_breaking import triton as stick_breaking_triton
        return getattr(stick_breaking_triton, name)
    if name in ("NSABlockSizes", "default_nsa_block_sizes"):
        from .ops.nsa import triton as nsa_triton
        return getattr(nsa_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
