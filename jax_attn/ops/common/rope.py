"""Rotary position embedding (RoPE) in jnp: the pairs, the frequencies and the plain rotation.

theta_i = base ** (-2 i / D), i in [0, D/2). A token at position p rotates each pair of features
by the angle p * theta_i:
  style="interleaved": pairs (2i, 2i + 1)   (the original project; GPT-J)
  style="half":        pairs (i, i + D/2)   (LLaMA, GPT-NeoX)
  (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos).
The fused kernels rotate q and k after load; `apply_rope` is the reference (rotate, then attend).
"""
from __future__ import annotations

import jax.numpy as jnp

from attn_spec.rope import ROPE_STYLES, Rope  # noqa: F401  (the config; re-exported)


def split_pairs(x, style: str):
    """[..., D] -> (x_a, x_b), each [..., D/2]: the two members of every rotated pair."""
    if style == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def merge_pairs(x_a, x_b, style: str):
    """Inverse of `split_pairs`."""
    if style == "interleaved":
        return jnp.stack([x_a, x_b], axis=-1).reshape(*x_a.shape[:-1], 2 * x_a.shape[-1])
    return jnp.concatenate([x_a, x_b], axis=-1)


def wide_float(dtype):
    """float32, or float64 for float64: the compute dtype of the plain references (spelled out, as
    jax's strict dtype promotion refuses promote_types(bfloat16, float32))."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def inverse_frequencies(head_dim: int, base: float, dtype=jnp.float32):
    """theta_i = base ** (-2 i / D), [D/2]."""
    return base ** (-jnp.arange(0, head_dim // 2, dtype=dtype) * 2 / head_dim)


def apply_rope(x, positions, rope: Rope):
    """Rotate x [B, S, H, D] by positions [B, S] (None: arange) (plain jnp; in float32 or wider)."""
    compute = wide_float(x.dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    angle = positions.astype(compute)[:, :, None, None] * inverse_frequencies(x.shape[-1], rope.base, compute)[None, None, None]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x_a, x_b = split_pairs(x.astype(compute), rope.style)
    out = merge_pairs(x_a * cos - x_b * sin, x_a * sin + x_b * cos, rope.style)
    return out.astype(x.dtype)
