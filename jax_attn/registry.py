"""Which implementation computes a call: name -> function, per variant, and the rule for None."""
from __future__ import annotations

import functools
from typing import Callable

from jax_attn.device import pallas_triton_unsupported_reason
from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.softmax import mosaic as softmax_mosaic
from jax_attn.ops.softmax import reference as softmax_reference
from jax_attn.ops.softmax import triton as softmax_triton
from jax_attn.ops.stick_breaking import reference as stick_breaking_reference
from jax_attn.ops.stick_breaking import triton as stick_breaking_triton

# name -> fn(q, k, v, q_seg, kv_seg, spec, *, q_pos, kv_pos) -> (out, lse). Adding a backend = one entry.
SOFTMAX: dict[str, Callable] = {
    "pallas_triton": softmax_triton.flash_attention_pallas,
    # the Hopper kernels (`ops/softmax/mosaic.py`), wired through the engine's padding and custom_vjp
    "mosaic_gpu": functools.partial(softmax_triton.flash_attention_pallas, kernels="mosaic_gpu"),
    "xla": softmax_reference.attention_reference,
}

# name -> fn(q, k, v, decay, spec, *, pos) -> (out, rem).
STICK_BREAKING: dict[str, Callable] = {
    "pallas_triton": stick_breaking_triton.stick_breaking_pallas,
    # the forward on the Hopper kernel (`ops/stick_breaking/mosaic.py`), the backward on Pallas Triton's
    "mosaic_gpu": functools.partial(stick_breaking_triton.stick_breaking_pallas, forward="mosaic_gpu"),
    "xla": stick_breaking_reference.stick_breaking_reference,
}
IMPLEMENTATIONS = SOFTMAX


def default_implementation(spec: AttentionSpec | None = None, head_dim: int | None = None,
                           dtype=None, positions: bool = False) -> str:
    """The rule for implementation=None: the Pallas engine wherever Pallas Triton runs — compiled
    on NVIDIA sm80+ GPUs, through the interpreter on CPU; "xla" anywhere else (e.g. TPU). Given
    the call (spec, head dim, dtype, whether RoPE positions are given), "mosaic_gpu" where its
    Hopper kernels serve it (faster than the Triton engine on an H100; `benchmarks/`)."""
    if pallas_triton_unsupported_reason() is not None:
        return "xla"
    if spec is not None and softmax_mosaic.unsupported_reason(spec, head_dim, dtype, positions) is None:
        return "mosaic_gpu"
    return "pallas_triton"
