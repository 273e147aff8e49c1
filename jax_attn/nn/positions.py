"""Absolute sinusoidal position encodings in jnp: a layer concern, not a kernel's.

The formula (PE[p, 2i] = sin(p / 10000 ** (2i / d)), PE[p, 2i + 1] = cos(...)) and the argument
checks are those of `attn_spec.positions`, evaluated here with `jax.numpy` in float32 or wider
(float64 for float64 requests), then cast to the requested dtype. `torch_ref.nn.positions` is the
PyTorch twin.
"""
from __future__ import annotations

import jax.numpy as jnp

from attn_spec.positions import check_dim, check_length, sinusoidal_encoding
from jax_attn.ops.common.rope import wide_float


def sinusoidal_at(positions, dim: int, dtype=jnp.float32):
    """The encoding of integer `positions` (any shape [...]): [..., dim]."""
    dim = check_dim(dim)
    compute = wide_float(dtype)
    pair_index = jnp.arange(0, dim // 2, dtype=compute)
    return sinusoidal_encoding(jnp.asarray(positions).astype(compute), pair_index, jnp).astype(dtype)


def sinusoidal_positions(length: int, dim: int, dtype=jnp.float32):
    """The table PE [length, dim] for positions 0 .. length - 1."""
    return sinusoidal_at(jnp.arange(check_length(length)), dim, dtype)
