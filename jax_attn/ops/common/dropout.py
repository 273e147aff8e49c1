"""Attention dropout in JAX: the hash of `attn_spec.dropout` on jnp uint32 values, which the Pallas
kernels evaluate per tile and the plain reference over the whole [B, H, Sq, Sk] grid."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from attn_spec import dropout as plan

def _u32(x):
    return jnp.uint32(x) if isinstance(x, int) else jnp.asarray(x).astype(jnp.uint32)


JNP_OPS = types.SimpleNamespace(u32=_u32,
                                i32=lambda x: x.astype(jnp.int32),
                                shr=lambda x, n: jax.lax.shift_right_logical(x, jnp.uint32(n)))


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
    """Per query row of (batch b, query head h): the row's hash (`seed` uint32 [2], a ref or array)."""
    ops = JNP_OPS
    return plan.row_bits(plan.stream(seed[0], seed[1], b, h, num_heads, ops), rows, ops)


def keep(row, cols, rate: float):
    """row bits and key rows broadcast against each other -> bool, True where kept."""
    return plan.keep(row, plan.col_bits(cols, JNP_OPS), rate, JNP_OPS)


def keep_mask(seed, batch: int, num_heads: int, q_len: int, kv_len: int, rate: float):
    """[B, H, Sq, Sk] bool (the plain reference's mask)."""
    b = jnp.arange(batch)[:, None, None, None]
    h = jnp.arange(num_heads)[None, :, None, None]
    row = row_bits(seed, b, h, num_heads, jnp.arange(q_len)[None, None, :, None])
    return keep(row, jnp.arange(kv_len)[None, None, None, :], rate)
