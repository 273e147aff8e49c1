"""Visit plans in JAX: the planner of `attn_spec.visit` (which key blocks each query block visits,
and the transpose for dK/dV) with run-time narrowing by segment ids, and its closed form for the
Mosaic kernels' traced scalars.

Causality and windows are static (the cached NumPy table); segment ids narrow [lo, hi) at run
time (jnp, a few hundred elements).
"""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from attn_spec import visit as plan
from attn_spec.visit import block_lists  # noqa: F401  (re-exported: explicit block lists)
from jax_attn.ops.common.spec import AttentionSpec

JNP_OPS = types.SimpleNamespace(minimum=jnp.minimum, maximum=jnp.maximum, cdiv=pl.cdiv)
_SEGMENT_OPS = types.SimpleNamespace(
    argsort=lambda x: jnp.argsort(x, axis=-1, stable=True), take=lambda x, i: jnp.take_along_axis(x, i, axis=-1),
    searchsorted_left=jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left")), where=jnp.where,
    minimum=jnp.minimum)


def first_visible_keys(q_ids, kv_ids):
    """`attn_spec.visit.first_visible_keys` in jnp: per query row the first key with its segment id
    (Sk where none), [B, Sq]."""
    return plan.first_visible_keys(q_ids, kv_ids, _SEGMENT_OPS)


def reach(spec: AttentionSpec):
    """(before, after): query i sees keys i - before <= j <= i + after (None: unbounded). Under an
    ordering (spec.ordered) only the window bounds the tiles: causality compares original positions,
    which no tile of ordered rows can bound in general."""
    return plan.reach(spec.causal and not spec.ordered, spec.window_left, spec.window_right, spec.offset)


def partner_blocks(first, size: int, block: int, num: int, before, after, last_masked: bool = False,
                   valid: int | None = None):
    """`attn_spec.visit.partner_blocks` on traced jnp scalars (the Mosaic kernels)."""
    return plan.partner_blocks(first, size, block, num, before, after, last_masked, valid, ops=JNP_OPS)


def block_ranges(spec: AttentionSpec, q_len, kv_len, block_q, block_k, nq, nk,
                 q_seg=None, kv_seg=None, *, key_major: bool):
    """Visited block ranges, int32 [B or 1, n_outer, 4] = (lo, plain_lo, plain_hi, hi).

    key_major=False: for each query block, the key blocks it visits (forward, dQ).
    key_major=True: for each key block, the query blocks that visit it (dK/dV).
    Segment ids ([B, nq*block_q], [B, nk*block_k], padded) narrow the ranges where the id
    intervals of two blocks do not overlap; with segments no block counts as mask-free.
    """
    before, after = reach(spec)
    if not spec.has_segments:
        table = plan.block_table(before, after, q_len, kv_len, block_q, block_k, nq, nk, key_major)
        if spec.ordered and spec.causal:  # original-position causality: every visited tile masked
            table = np.concatenate([table[:, :1], table[:, 3:], table[:, 3:], table[:, 3:]], axis=1)
        return jnp.asarray(table.copy())[None]  # a copy per use, as every traced constant
    any_, _ = plan.block_masks(before, after, q_len, kv_len, block_q, block_k, nq, nk)
    qb = q_seg.reshape(q_seg.shape[0], nq, block_q)
    kb = kv_seg.reshape(kv_seg.shape[0], nk, block_k)
    qmin, qmax = qb.min(-1), qb.max(-1)
    kmin, kmax = kb.min(-1), kb.max(-1)
    overlap = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
    if key_major:
        overlap, any_ = overlap.transpose(0, 2, 1), any_.T
    seg_any = overlap & jnp.asarray(any_)[None]
    return plan.intervals(seg_any, jnp.zeros_like(seg_any), xp=jnp)
