"""NSA visit plans in jnp (cheap XLA on the small index arrays, shared by the reference and the
kernels): canonical block lists, disjoint ranges, and the transpose of the block lists for dK/dV.

- `canonical_blocks`: every row's selected blocks, ascending and unique, the ignored entries (-1,
  beyond the causal frontier or the sequence, past `block_counts`, repeated) as -1 at the end, and
  the count of the rest. After it, "a key counts once" holds by construction.
- `disjoint_ranges`: every row's `[start, end)` ranges sorted by start and clipped against the
  ranges before them (and, causal, to the row's own position), so their union is their sum.
- `transpose_plan`: for every (batch, kv head, key block) the query tokens that selected it, in
  ascending order (a stable sort of (block, token) pairs): the dK/dV kernel walks that list, so
  dK/dV need no atomics and are deterministic; the block-visiting forward and dQ write one partial
  per pair in that order and find a token's pairs through `places`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


def canonical_blocks(block_indices, block_counts, block_size: int, seq_len: int, causal: bool):
    """block_indices int [B, S, Hkv, n], block_counts int [B, S, Hkv] or None ->
    (blocks int32 [B, S, Hkv, n]: valid ones ascending then -1, counts int32 [B, S, Hkv])."""
    idx = block_indices.astype(jnp.int32)
    n = idx.shape[-1]
    num_blocks = -(-seq_len // block_size)
    valid = (idx >= 0) & (idx < num_blocks)
    if causal:  # block j starts at j * block_size: beyond the frontier when that is past the row
        rows = jnp.arange(idx.shape[1], dtype=jnp.int32)[None, :, None, None]
        valid &= idx * block_size <= rows
    if block_counts is not None:
        slots = jnp.arange(n, dtype=jnp.int32)[None, None, None, :]
        valid &= slots < block_counts.astype(jnp.int32)[..., None]
    idx = jnp.sort(jnp.where(valid, idx, _BIG), axis=-1)
    repeat = jnp.concatenate([jnp.zeros_like(idx[..., :1], bool), idx[..., 1:] == idx[..., :-1]], axis=-1)
    idx = jnp.sort(jnp.where(repeat, _BIG, idx), axis=-1)
    keep = idx != _BIG
    return jnp.where(keep, idx, -1), keep.sum(-1, dtype=jnp.int32)


def disjoint_ranges(ranges, seq_len: int, causal: bool):
    """ranges int [B, S, Hkv, R, 2] ([start, end), validated start <= end) -> int32 [B, S, Hkv, R, 2]
    disjoint, sorted by start, each clipped to [0, seq_len) and (causal) to keys <= the row; empty
    ones have start == end."""
    r = ranges.astype(jnp.int32)
    start, end = jnp.clip(r[..., 0], 0, seq_len), jnp.clip(r[..., 1], 0, seq_len)
    if causal:
        limit = jnp.arange(r.shape[1], dtype=jnp.int32)[None, :, None, None] + 1
        end = jnp.minimum(end, limit)
    order = jnp.argsort(start, axis=-1, stable=True)
    start, end = jnp.take_along_axis(start, order, -1), jnp.take_along_axis(end, order, -1)
    # the union as a sum: each range starts where the ranges before it end (if later)
    reach = jnp.concatenate([jnp.zeros_like(end[..., :1]), jax.lax.cummax(end, axis=end.ndim - 1)[..., :-1]],
                            axis=-1)
    start = jnp.maximum(start, reach)
    end = jnp.maximum(end, start)
    return jnp.stack([start, end], axis=-1)


def transpose_plan(blocks, num_blocks: int):
    """blocks int32 [B, S, Hkv, n] (canonical: -1 ignored) -> (tokens int32 [B, Hkv, S * n]: the
    tokens of every key block one after the other, ascending within a block, then padding;
    offsets int32 [B, Hkv, num_blocks + 1]: block j's tokens are tokens[offsets[j]:offsets[j+1]];
    places int32 [B, Hkv, S * n]: where the pair (token t, slot i) of `blocks` stands in that
    order, at t * n + i)."""
    batch, seq_len, heads, n = blocks.shape
    key = jnp.where(blocks >= 0, blocks, num_blocks).transpose(0, 2, 1, 3).reshape(batch, heads, seq_len * n)
    order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)  # stable: tokens ascending per block
    tokens = order // n
    sorted_key = jnp.take_along_axis(key, order, -1)
    bounds = jnp.arange(num_blocks + 1, dtype=jnp.int32)
    search = jax.vmap(jax.vmap(lambda s: jnp.searchsorted(s, bounds, side="left")))
    ranks = jnp.broadcast_to(jnp.arange(seq_len * n, dtype=jnp.int32), order.shape)
    places = jnp.zeros_like(order).at[
        jnp.arange(batch)[:, None, None], jnp.arange(heads)[None, :, None], order].set(ranks)
    return tokens, search(sorted_key).astype(jnp.int32), places


def tile_union(blocks, tokens: int):
    """The blocks a program of `tokens` consecutive query tokens walks: blocks int32 [B, L, Hkv, n]
    (canonical, L a multiple of tokens) -> (union int32 [B, L / tokens, Hkv, tokens * n]: every
    block some token of the tile selected, once, ascending, then -1; member int32 (same shape):
    bit i set where token i of the tile selected it; counts int32 [B, Hkv, L / tokens])."""
    batch, length, heads, n = blocks.shape
    per_token = blocks.reshape(batch, length // tokens, tokens, heads, n).transpose(0, 1, 3, 2, 4)
    union, counts = canonical_blocks(per_token.reshape(batch, length // tokens, heads, tokens * n), None, 1,
                                     _BIG, causal=False)
    chosen = (union[..., :, None, None] == per_token[..., None, :, :]).any(-1) & (union >= 0)[..., None]
    bits = jnp.arange(tokens, dtype=jnp.int32)[None, None, None, None, :]
    member = (chosen.astype(jnp.int32) << bits).sum(-1, dtype=jnp.int32)
    return union, member, counts.transpose(0, 2, 1)
