"""Visit plans: which key blocks each query block visits, and the transpose for dK/dV.

For every query block the visible key blocks form one interval [lo, hi), and inside it the blocks
that need no element mask form [full_lo, full_hi). Causality and windows are static (NumPy at
trace time, cached); segment ids narrow [lo, hi) at run time (jnp, a few hundred elements). The
transpose (query blocks per key block) drives the dK/dV kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.ops.common.spec import AttentionSpec


@functools.lru_cache(maxsize=256)
def static_block_masks(spec: AttentionSpec, q_len, kv_len, block_q, block_k, nq, nk):
    """(any, all) visibility per (query block, key block), from causality, window and kv_len."""
    r0 = np.arange(nq)[:, None] * block_q  # first row of each query block
    r1_real = np.minimum(r0 + block_q, q_len) - 1  # last real row ("any" ignores padding rows)
    r1_pad = r0 + block_q - 1  # last row incl. padding ("all" must hold for padding rows too)
    c0 = np.arange(nk)[None, :] * block_k
    c1 = c0 + block_k - 1
    big = 1 << 40
    left = big if spec.window_left is None else spec.window_left
    right = big if spec.right_reach is None else spec.right_reach
    # Row r sees the interval [r - left, r + right]; both ends grow with r, so a block of rows
    # sees the union [r0 - left, r1 + right] and sees every key of [c0, c1] iff
    # r1 - left <= c0 and c1 <= r0 + right.
    any_ = (c0 <= r1_real + right) & (c1 >= r0 - left) & (c0 < kv_len) & (r0 < q_len)
    all_ = (c0 >= r1_pad - left) & (c1 <= r0 + right) & (c1 < kv_len)
    return any_, all_ & any_


def ranges_from_masks(any_, all_):
    """Per row of the block matrices: (lo, full_lo, full_hi, hi) int32, jnp or np alike."""
    xp = jnp if isinstance(any_, jax.Array) or isinstance(all_, jax.Array) else np
    n = any_.shape[-1]
    idx = xp.arange(n)
    lo = xp.min(xp.where(any_, idx, n), axis=-1)
    hi = xp.max(xp.where(any_, idx + 1, 0), axis=-1)
    hi = xp.maximum(hi, lo)  # an empty row gives lo = hi = n
    full_lo = xp.min(xp.where(all_, idx, n), axis=-1)
    full_hi = xp.max(xp.where(all_, idx + 1, 0), axis=-1)
    full_lo = xp.clip(full_lo, lo, hi)
    full_hi = xp.clip(full_hi, full_lo, hi)
    return xp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(xp.int32)


def block_ranges(spec: AttentionSpec, q_len, kv_len, block_q, block_k, nq, nk,
                 q_seg=None, kv_seg=None, *, key_major: bool):
    """Visited block ranges, int32 [B or 1, n_outer, 4] = (lo, full_lo, full_hi, hi).

    key_major=False: for each query block, the key blocks it visits (forward, dQ).
    key_major=True: for each key block, the query blocks that visit it (dK/dV).
    Segment ids ([B, nq*block_q], [B, nk*block_k], padded) narrow the ranges where the id
    intervals of two blocks do not overlap; with segments no block counts as mask-free.
    """
    any_, all_ = static_block_masks(spec, q_len, kv_len, block_q, block_k, nq, nk)
    if key_major:
        any_, all_ = any_.T, all_.T
    if not spec.has_segments:
        return jnp.asarray(ranges_from_masks(any_, all_))[None]
    qb = q_seg.reshape(q_seg.shape[0], nq, block_q)
    kb = kv_seg.reshape(kv_seg.shape[0], nk, block_k)
    qmin, qmax = qb.min(-1), qb.max(-1)
    kmin, kmax = kb.min(-1), kb.max(-1)
    overlap = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
    if key_major:
        overlap = overlap.transpose(0, 2, 1)
    seg_any = overlap & jnp.asarray(any_)[None]
    return ranges_from_masks(seg_any, jnp.zeros_like(seg_any))
