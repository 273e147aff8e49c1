"""Plain-jnp attention: the `"xla"` implementation and the reference every kernel is tested against.

Materialises the [B, Hq, Sq, Sk] scores, so it is for checking and for small shapes. Run in float64
(under `jax.enable_x64(True)`) it is the golden; in the compute dtype it is the "naive" reference of
the tolerance rule. Gradients come from JAX autodiff.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_spec import dropout as plan
from jax_attn.ops.common import dropout
from jax_attn.ops.common.rope import apply_rope
from jax_attn.ops.common.spec import AttentionSpec, visible


def attention_reference(q, k, v, q_seg, kv_seg, spec: AttentionSpec, *, q_pos=None, kv_pos=None, slopes=None,
                        seed=None, q_orig=None, kv_orig=None):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], ids [B, Sq]/[B, Sk] or None -> (out, lse [B, Hq, Sq]).

    With spec.rope, q and k are first rotated by q_pos [B, Sq] / kv_pos [B, Sk] (plain jnp); with
    spec.dropout, the probabilities are dropped by the mask of `seed` (uint32 [2]). With
    spec.ordered the rows are those of an ordered sequence and q_orig [Sq] / kv_orig [Sk] (or
    [B, S]) their original positions, which causality and the ALiBi distance compare."""
    if spec.rope is not None:
        q, k = apply_rope(q, q_pos, spec.rope), apply_rope(k, kv_pos, spec.rope)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # [B, Hkv, G, Sq, Sk]: query head h = kv_head * G + g reads kv head `kv_head`.
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=spec.precision,
                   preferred_element_type=jnp.float32 if q.dtype != jnp.float64 else None)
    s = s * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    rows = jnp.arange(q_len)[None, None, None, :, None]  # against s [B, Hkv, G, Sq, Sk]
    cols = jnp.arange(kv_len)[None, None, None, None, :]
    if spec.ordered:
        q_tokens = jnp.broadcast_to(jnp.asarray(q_orig), (batch, q_len))
        kv_tokens = jnp.broadcast_to(jnp.asarray(kv_orig), (batch, kv_len))
        q_orig, kv_orig = q_tokens[:, None, None, :, None], kv_tokens[:, None, None, None, :]
    if spec.alibi:  # -slope_h |i + offset - j|, per query head h = kv_head * G + g; ordered: original positions
        slope = slopes.astype(s.dtype).reshape(num_kv_heads, group)[None, :, :, None, None]
        distance = q_orig - kv_orig if spec.ordered else rows + spec.offset - cols
        s = s - slope * jnp.abs(distance).astype(s.dtype)
    seg_q = q_seg[:, None, None, :, None] if spec.has_segments else None
    seg_k = kv_seg[:, None, None, None, :] if spec.has_segments else None
    mask = visible(spec, rows, cols, kv_len, seg_q, seg_k, q_orig, kv_orig)
    mask = jnp.broadcast_to(mask, s.shape)
    s = jnp.where(mask, s, -jnp.inf)
    # Softmax that stays finite on rows with no visible key (output 0, lse -inf, zero grads).
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0
    p = p / jnp.where(empty, 1.0, l)
    if spec.dropout:  # the kernels' mask, [B, Hq, Sq, Sk] -> [B, Hkv, G, Sq, Sk]
        row_bits, col_bits = dropout.tables(seed, batch, num_heads, q_len, kv_len)
        col_bits = jnp.broadcast_to(col_bits, (batch, kv_len))
        if spec.ordered:  # the bits of the tokens the ordered rows hold: the mask of the unordered call
            row_bits = jnp.take_along_axis(row_bits, q_tokens[:, None, :], axis=2)
            col_bits = jnp.take_along_axis(col_bits, kv_tokens, axis=1)
        keep = dropout.keep(row_bits[..., None], col_bits[:, None, None, :], spec.dropout)
        keep = keep.reshape(batch, num_kv_heads, group, q_len, kv_len)
        p = jnp.where(keep, p * plan.scale(spec.dropout), jnp.zeros((), p.dtype))
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, precision=spec.precision)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
    out = out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
    lse = lse.reshape(batch, num_heads, q_len)
    return out, lse
