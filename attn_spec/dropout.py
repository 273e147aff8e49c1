"""Attention dropout's random bits: one counter-based hash that every implementation of both
frameworks evaluates alike, so that a seed gives the same mask in the kernels, in the plain
references and in either framework, and the backward regenerates it instead of storing it.

Element (b, h, i, j) (batch, query head, query row, key row) of a call with seed words (s0, s1)
is kept when `bits >= threshold(rate)`, with all arithmetic on uint32, wrapping:

    stream = mix(s0 ^ mix(s1 ^ (b * H + h)))     one per (batch, head)
    row_i  = mix(stream ^ i) | 1                 one per query row
    col_j  = mix(j + GOLDEN) | 1                 one per key row
    bits   = row_i * col_j                       one per element

`mix` is MurmurHash3's 32-bit finaliser (a bijection with full avalanche), so the row and column
hashes are full-strength and an element costs one integer multiply and one compare, which is what
dropout costs in the kernels (three times per element: forward, dK/dV and dQ). Both factors are odd,
so a row's bits are a bijection of its columns' hashes and a column's of its rows': no row or column
can collapse to zero. A sum or XOR of the two hashes would tie the four elements (i, j), (i', j),
(i, j'), (i', j') together linearly; the product's high bits do not (drop fractions, neighbour and
2x2 statistics match independent draws: `tests/test_dropout.py`). The kernels take row_i and col_j
hashed once per call (each framework's `tables`). Kept elements are scaled by 1 / (1 - rate).
A seed is two uint32 words: JAX takes them from a PRNG key (`jax.random.key_data` of a threefry
key), torch from an int s in [0, 2^64) (`seed_words`: (s >> 32, s & 0xffffffff), threefry's layout).
So torch's `dropout_seed=s` and `jax.random.wrap_key_data(jnp.array(seed_words(s), jnp.uint32))`
give the same mask for every s, and `jax.random.key(s)` does for s < 2^32 (s < 2^63 under
jax_enable_x64; without it, key(s) keeps only the low word).

The functions take `ops`, a namespace of the array library's uint32 operations, so that one
definition serves NumPy here, jnp (in and outside Pallas kernels) and Triton.
"""
from __future__ import annotations

import types

import numpy as np

MIX1, MIX2, GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def threshold(rate: float) -> int:
    """The uint32 threshold: an element is dropped when its 32 random bits fall below it."""
    return min(int(round(rate * 2 ** 32)), 2 ** 32 - 1)


def scale(rate: float) -> float:
    """The kept elements' factor 1 / (1 - rate)."""
    return 1.0 / (1.0 - rate)


def seed_words(seed: int) -> tuple[int, int]:
    """An int seed in [0, 2^64) -> (s0, s1), the high and the low word (threefry's key layout)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"dropout_seed must be an int in [0, 2**64), got {seed!r}")
    return int(seed) >> 32, int(seed) & 0xFFFFFFFF


def mix(x, ops):
    """MurmurHash3's fmix32 on uint32 values."""
    x = x ^ ops.shr(x, 16)
    x = x * ops.u32(MIX1)
    x = x ^ ops.shr(x, 13)
    x = x * ops.u32(MIX2)
    return x ^ ops.shr(x, 16)


def stream(s0, s1, b, h, num_heads: int, ops):
    return mix(s0 ^ mix(s1 ^ (ops.u32(b) * ops.u32(num_heads) + ops.u32(h)), ops), ops)


def row_bits(stream_, rows, ops):
    return mix(stream_ ^ ops.u32(rows), ops) | ops.u32(1)


def col_bits(cols, ops):
    return mix(ops.u32(cols) + ops.u32(GOLDEN), ops) | ops.u32(1)


def keep(row, col, rate: float, ops):
    """row_bits and col_bits broadcast against each other -> bool, True where kept."""
    return ops.ge(row * col, threshold(rate))


NUMPY_OPS = types.SimpleNamespace(
    u32=lambda x: np.asarray(x).astype(np.uint32), shr=lambda x, n: x >> np.uint32(n),
    ge=lambda x, t: x >= np.uint32(t))


def keep_mask(seed: tuple[int, int], batch: int, num_heads: int, q_len: int, kv_len: int, rate: float) -> np.ndarray:
    """[B, H, Sq, Sk] bool, the mask in NumPy (for tests)."""
    ops = NUMPY_OPS
    with np.errstate(over="ignore"):
        s0, s1 = ops.u32(seed[0]), ops.u32(seed[1])
        b, h = np.meshgrid(np.arange(batch), np.arange(num_heads), indexing="ij")
        st = stream(s0, s1, b, h, num_heads, ops)[:, :, None, None]
        row = row_bits(st, np.arange(q_len)[None, None, :, None], ops)
        return keep(row, col_bits(np.arange(kv_len), ops)[None, None, None, :], rate, ops)
