"""Attention dropout in JAX: the hash of `attn_spec.dropout` on jnp uint32 values. The Pallas kernels
take a call's row and column bits (`tables`) and the kept elements' factor (`scale_input`), and
evaluate `keep` and `weight` per tile; the plain reference
evaluates it over the whole [B, H, Sq, Sk] grid."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from attn_spec import dropout as plan

def _u32(x):
    return jnp.uint32(x) if isinstance(x, int) else jnp.asarray(x).astype(jnp.uint32)


JNP_OPS = types.SimpleNamespace(u32=_u32,
                                shr=lambda x, n: jax.lax.shift_right_logical(x, jnp.uint32(n)),
                                ge=lambda x, t: x >= jnp.uint32(t))


def seed_words(key):
    """A PRNG key (typed or raw) -> uint32 [2]: its two threefry words, else two words drawn from it."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
    else:
        data = key
    if data.shape == (2,) and data.dtype == jnp.uint32:
        return data
    return jax.random.bits(key, (2,), jnp.uint32)


def row_bits(seed, b, h, num_heads, rows):
    """Per query row of (batch b, query head h): the row's hash (`seed` uint32 [2])."""
    ops = JNP_OPS
    return plan.row_bits(plan.stream(seed[0], seed[1], b, h, num_heads, ops), rows, ops)


def col_bits(cols):
    return plan.col_bits(cols, JNP_OPS)


def keep(row, col, rate: float):
    """Row and column bits broadcast against each other -> bool, True where kept."""
    return plan.keep(row, col, rate, JNP_OPS)


def weight(keep, scale):
    """1 / (1 - rate) where kept, else 0: the backward's factor of a kept probability and of dP.
    `scale` is read from an input at run time (`scale_input`): with the factor a constant, the
    compiler turns p * weight into a select on the 16-bit values after their conversion, or keeps a
    p * 0 beside it. (The forward selects p and scales its output rows once.)"""
    return jnp.where(keep, scale, 0.0)


def scale_input(rate: float):
    """float32 [1]: 1 / (1 - rate), the kernels' run-time `scale` of `weight`."""
    return jnp.full((1,), plan.scale(rate), jnp.float32)


def tables(seed, batch: int, num_heads: int, q_len: int, kv_len: int):
    """(rows uint32 [B, H, Sq], cols uint32 [Sk]): every query row's and key row's bits, hashed once
    per call; the kernels load them like the row statistics and take one product per element."""
    b = jnp.arange(batch)[:, None, None]
    h = jnp.arange(num_heads)[None, :, None]
    return row_bits(seed, b, h, num_heads, jnp.arange(q_len)[None, None, :]), col_bits(jnp.arange(kv_len))


def keep_mask(seed, batch: int, num_heads: int, q_len: int, kv_len: int, rate: float):
    """[B, H, Sq, Sk] bool (the plain reference's mask)."""
    rows, cols = tables(seed, batch, num_heads, q_len, kv_len)
    return keep(rows[..., None], cols[None, None, None, :], rate)
