"""Ordered attention, the explicit composite: `unpermute(attn(permute(q), permute(k), permute(v)))`
with causality on the original positions and segment ids per original token (docs/design/orderings.md).

Plain jnp around the variants' references: the `"xla"` implementation of ordered calls and the
reference every kernel is tested against (float64 under jax.enable_x64). It materialises the
permuted copies that the kernels never make."""
from __future__ import annotations

import jax.numpy as jnp

from jax_attn.ops.common.spec import AttentionSpec
from jax_attn.ops.dilated.reference import dilated_reference
from jax_attn.ops.softmax.reference import attention_reference


def _inverse(perm):
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def ordered_attention_reference(q, k, v, q_seg, kv_seg, spec: AttentionSpec, perm, seed=None, slopes=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D], ids [B, S] or None, perm int [S], spec.ordered ->
    (out [B, S, Hq, D], lse [B, Hq, S]) in the original order: the window on the ordered sequence,
    causality and the ALiBi distance (slopes [Hq]) on the original positions perm[t], dropout
    (seed) per pair of original tokens."""
    perm = jnp.asarray(perm).astype(jnp.int32)
    take = lambda x: jnp.take(x, perm, axis=1)
    ids = (None, None) if q_seg is None else (take(q_seg), take(kv_seg))
    out, lse = attention_reference(take(q), take(k), take(v), *ids, spec, slopes=slopes, seed=seed, q_orig=perm,
                                   kv_orig=perm)
    inv = _inverse(perm)
    return jnp.take(out, inv, axis=1), jnp.take(lse, inv, axis=2)


def ordered_dilated_reference(q, k, v, perm, **kwargs):
    """`dilated_reference` on the ordered sequence (segments cut from it), causality on the
    original positions perm[t]; out [B, S, H, D] and lse [B, H, S] in the original order."""
    perm = jnp.asarray(perm).astype(jnp.int32)
    take = lambda x: jnp.take(x, perm, axis=1)
    out, lse = dilated_reference(take(q), take(k), take(v), positions=perm, **kwargs)
    inv = _inverse(perm)
    return jnp.take(out, inv, axis=1), jnp.take(lse, inv, axis=2)
