"""Dilated attention (LongNet) on sequence-sharded arrays: the rows of one dilated branch.

With the shard length L a multiple of every rate r, a branch (w, r) keeps, of a shard's rows, those
with local index j = offset (mod r), offset = h mod r for head h. `select` compacts them, per head,
to [B, L / r, H, D] (a reshape and an index per head; keys and values first repeated to the query
heads, since heads of one GQA group keep different rows), `scatter` puts a branch's compact output
and lse back on the full rows (0 and -inf on the rows it does not keep). A segment inside a shard
needs no traffic; a segment over g shards is ring attention on the compact rows over rings of those
g shards (`ring.Static.group`): only the dilated rows travel.

Under an ordering applied within each shard (`order`, the shard's permutation: ordered position t
holds local row order[t]) a branch keeps the rows at ordered positions j = offset (mod r):
`select` gathers them from their original rows order[m * r + offset] (kv heads indexed per query
head, no repeated copy) and `scatter` puts the results back there.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _ordered_rows(order, rate: int, num_heads: int):
    """The local rows a branch keeps under `order` [L]: int [L / rate, H], order[m * rate + h mod rate]."""
    length = order.shape[0]
    ordered = np.arange(0, length, rate)[:, None] + (np.arange(num_heads) % rate)[None, :]
    return jnp.asarray(order)[ordered]


def select(x, rate: int, num_heads: int, order=None):
    """[B, L, Hx, D] -> [B, L / rate, H, D]: row m of head h is row m * rate + (h mod rate), or
    with `order` [L] (the shard's permutation) row order[m * rate + (h mod rate)]."""
    batch, length, heads, dim = x.shape
    if order is not None:  # one gather of the kept rows; query head h reads kv head h // group
        kv_head = (np.arange(num_heads) // (num_heads // heads))[None, :]
        return x[:, _ordered_rows(order, rate, num_heads), kv_head]
    if heads != num_heads:  # kv heads: every query head reads its own copy (its rows differ)
        x = jnp.repeat(x, num_heads // heads, axis=2)
    offsets, head_ids = np.arange(num_heads) % rate, np.arange(num_heads)
    return x.reshape(batch, length // rate, rate, num_heads, dim)[:, :, offsets, head_ids]


def scatter(out, lse, rate: int, order=None):
    """The inverse of `select` on a branch's out [B, L / r, H, D] and lse [B, H, L / r] -> out
    [B, L, H, D] (0 on rows the branch does not keep) and lse [B, H, L] (-inf there); `order` as
    for `select`."""
    batch, rows, num_heads, dim = out.shape
    if order is not None:
        kept, head = _ordered_rows(order, rate, num_heads), np.arange(num_heads)[None, :]
        full = jnp.zeros((batch, rows * rate, num_heads, dim), out.dtype).at[:, kept, head].set(out)
        lse_full = jnp.full((batch, rows * rate, num_heads), -jnp.inf, lse.dtype)
        return full, lse_full.at[:, kept, head].set(lse.transpose(0, 2, 1)).transpose(0, 2, 1)
    offsets, head_ids = np.arange(num_heads) % rate, np.arange(num_heads)
    full = jnp.zeros((batch, rows, rate, num_heads, dim), out.dtype).at[:, :, offsets, head_ids].set(out)
    lse_full = jnp.full((batch, rows, rate, num_heads), -jnp.inf, lse.dtype)
    lse_full = lse_full.at[:, :, offsets, head_ids].set(lse.transpose(0, 2, 1))
    return (full.reshape(batch, rows * rate, num_heads, dim),
            lse_full.reshape(batch, rows * rate, num_heads).transpose(0, 2, 1))


def merge(outs, lses, out_dtype):
    """LongNet's merge (Eq. 10) of branch outputs [B, L, H, D] by their lse [B, H, L], in fp32 and
    differentiable; a row no branch keeps gives 0 and lse -inf."""
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    weights = [jnp.exp(x - m_safe) for x in lses]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    empty = total == 0.0
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    rows = lambda x: x.transpose(0, 2, 1)[..., None]
    out = outs[0].astype(jnp.float32) * rows(weights[0] * inv)
    for o, w in zip(outs[1:], weights[1:]):
        out = out + o.astype(jnp.float32) * rows(w * inv)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    return out.astype(out_dtype), lse
