"""Absolute sinusoidal position encodings (Vaswani et al. 2017): a layer concern, not a kernel's.

    PE[p, 2i]     = sin(p / 10000 ** (2i / d))
    PE[p, 2i + 1] = cos(p / 10000 ** (2i / d)),      i in [0, d/2), d = the model dimension.

Computed in float32 or wider (float64 for float64 requests), then cast to the requested dtype.
`torch_ref.positions` is the PyTorch twin (same formula, same evaluation order).
"""
from __future__ import annotations

import jax.numpy as jnp

BASE = 10000.0


def _check_dim(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"sinusoidal positions need a positive even dim, got dim={dim!r}")
    return dim


def sinusoidal_at(positions, dim: int, dtype=jnp.float32):
    """The encoding of integer `positions` (any shape [...]): [..., dim]."""
    dim = _check_dim(dim)
    compute = jnp.promote_types(dtype, jnp.float32)
    inv_freq = BASE ** (-jnp.arange(0, dim // 2, dtype=compute) * 2 / dim)  # 10000 ** (-2i / d)
    angle = jnp.asarray(positions).astype(compute)[..., None] * inv_freq
    pe = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)  # [..., d/2, 2]: (sin, cos) pairs
    return pe.reshape(*angle.shape[:-1], dim).astype(dtype)


def sinusoidal_positions(length: int, dim: int, dtype=jnp.float32):
    """The table PE [length, dim] for positions 0 .. length - 1."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, got length={length!r}")
    return sinusoidal_at(jnp.arange(length), dim, dtype)
