"""Native Sparse Attention in plain jnp: the `"xla"` implementation and the reference the kernels
are tested against (float64 under `jax.enable_x64`: the golden). Definitions: `attn_spec/nsa.py`.

Every branch is softmax attention under a dense mask built from its rule ([B, Hkv, Sq, Sk] in
memory: for checking and small shapes). Gradients come from JAX autodiff.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec import nsa


def _accumulate(dtype):
    return None if dtype == jnp.float64 else jnp.float32


def masked_attention(q, k, v, mask, scale: float, precision):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], mask bool [B or 1, Hkv or 1, Sq, Sk] (shared by a kv
    head's query heads) -> (out [B, Sq, Hq, D], lse [B, Hq, Sq]); a row with no visible key gives 0
    and lse -inf, zero gradients, no NaN."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=precision, preferred_element_type=_accumulate(q.dtype))
    s = s * jnp.asarray(scale, s.dtype)
    mask = jnp.broadcast_to(mask[:, :, None], s.shape)
    s = jnp.where(mask, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    p = jnp.where(mask, jnp.exp(s - m), jnp.zeros((), s.dtype))
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0
    p = p / jnp.where(empty, jnp.ones((), l.dtype), l)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, precision=precision)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, jnp.ones((), l.dtype), l)))
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype), lse.reshape(batch, num_heads, q_len)


def _segment_mask(q_ids, kv_ids):
    """[B, 1, Sq, Sk] (or None without ids)."""
    if q_ids is None:
        return None
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def selection_mask(blocks, ranges, block_size: int, seq_len: int, causal: bool, q_ids=None, kv_ids=None):
    """The selection branch's mask [B, Hkv, S, S]: keys of the row's canonical blocks
    (`plan.canonical_blocks`, -1 ignored) or of its disjoint ranges (`plan.disjoint_ranges`),
    causal, within the row's segment."""
    keys = jnp.arange(seq_len, dtype=jnp.int32)
    wide = keys[None, None, None, None, :]  # against [B, S, Hkv, n or R, 1]
    if blocks is not None:
        mask = (blocks[..., None] == wide // block_size).any(-2)
    else:
        start, end = ranges[..., 0, None], ranges[..., 1, None]
        mask = ((wide >= start) & (wide < end)).any(-2)
    mask = mask.transpose(0, 2, 1, 3)  # [B, Hkv, S, S]
    if causal:
        mask &= keys[None, None, None, :] <= keys[None, None, :, None]
    seg = _segment_mask(q_ids, kv_ids)
    return mask if seg is None else mask & seg


def selection_reference(q, k, v, blocks, ranges, *, block_size: int, causal: bool, scale: float, precision,
                        q_ids=None, kv_ids=None):
    """Exact attention over the selected keys (canonical blocks or disjoint ranges) -> (out, lse)."""
    mask = selection_mask(blocks, ranges, block_size, q.shape[1], causal, q_ids, kv_ids)
    return masked_attention(q, k, v, mask, scale, precision)


# ----------------------------------------------------------------------------------------------
# Compression
# ----------------------------------------------------------------------------------------------

def _blocks_of(x, block: int, stride: int):
    """x [B, S, H, D] -> [B, Nc, block, H, D], compression block i = keys [i*stride, i*stride+block)."""
    count = nsa.compressed_count(x.shape[1], block, stride)
    idx = (np.arange(count)[:, None] * stride + np.arange(block)[None, :]).astype(np.int32)
    return x[:, idx]


def compress_one(x, block: int, stride: int, params, precision):
    """phi over every complete block of x [B, S, H, D] -> [B, Nc, H, D] (mean pooling, or the MLP
    of `nsa.CompressParams` with its position embedding; exact erf GELU)."""
    blocks = _blocks_of(x, block, stride)
    acc = _accumulate(x.dtype)
    if params is None:
        return jnp.mean(blocks, axis=2, dtype=acc).astype(x.dtype)
    batch, count, _, heads, head_dim = blocks.shape
    cast = lambda a: jnp.asarray(a).astype(x.dtype)
    h = (blocks + cast(params.pos)[None, None, :, None, :]).transpose(0, 1, 3, 2, 4)
    h = h.reshape(batch, count, heads, block * head_dim)
    h = jnp.einsum("bnhf,fk->bnhk", h, cast(params.w1), precision=precision, preferred_element_type=acc)
    h = jax.nn.gelu(h + cast(params.b1).astype(h.dtype)[None, None, None, :], approximate=False).astype(x.dtype)
    out = jnp.einsum("bnhk,kd->bnhd", h, cast(params.w2), precision=precision, preferred_element_type=acc)
    return (out + cast(params.b2).astype(out.dtype)[None, None, None, :]).astype(x.dtype)


def compressed_segment_ids(ids, block: int, stride: int):
    """ids [B, S] -> (ids of the compressed keys [B, Nc], whether block i lies in one segment [B, Nc]):
    a query sees a compressed key only if the whole block carries its id."""
    count = nsa.compressed_count(ids.shape[1], block, stride)
    first = ids[:, np.arange(count) * stride]
    last = ids[:, np.arange(count) * stride + block - 1]
    return first, first == last


def compression_mask(seq_len: int, count: int, block: int, stride: int, q_ids=None, kv_ids=None):
    """[B or 1, 1, S, Nc]: query t sees compressed block i iff it is complete at t
    (`nsa.compressed_end(i) <= t`) and, with ids, the block lies in t's segment."""
    t = np.arange(seq_len)[:, None]
    mask = jnp.asarray(nsa.compressed_end(np.arange(count)[None, :], block, stride) <= t)[None, None]
    if q_ids is None:
        return mask
    kc_ids, whole = compressed_segment_ids(kv_ids, block, stride)
    return mask & ((q_ids[:, :, None] == kc_ids[:, None, :]) & whole[:, None, :])[:, None]


def compression_reference(q, k_cmp, v_cmp, *, block: int, stride: int, scale: float, precision, q_ids=None):
    """Block-causal attention over the compressed keys -> (out, lse)."""
    if k_cmp.shape[1] == 0:  # no complete block: every row sees nothing
        return jnp.zeros_like(q), jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    mask = compression_mask(q.shape[1], k_cmp.shape[1], block, stride, q_ids, q_ids)
    return masked_attention(q, k_cmp, v_cmp, mask, scale, precision)


# ----------------------------------------------------------------------------------------------
# Selection of the top-n blocks
# ----------------------------------------------------------------------------------------------

def importance_reference(q, k_cmp, lse, *, block: int, stride: int, select_block: int, scale: float, precision,
                         q_ids=None):
    """imp [B, S, Hkv, Ns] (fp32; float64 for the golden): the compression probabilities
    p = exp(scale q.k_cmp - lse) on the visible compressed keys, summed over the group's heads and
    mapped to selection blocks by `nsa.overlap_matrix`."""
    batch, seq_len, num_heads, head_dim = q.shape
    count, num_kv_heads = k_cmp.shape[1], k_cmp.shape[2]
    group = num_heads // num_kv_heads
    acc = _accumulate(q.dtype) or jnp.float64
    qg = q.reshape(batch, seq_len, num_kv_heads, group, head_dim)
    s = jnp.einsum("bthgd,bihd->bthgi", qg, k_cmp, precision=precision, preferred_element_type=acc)
    lse = lse.astype(acc).reshape(batch, num_kv_heads, group, seq_len).transpose(0, 3, 1, 2)[..., None]
    mask = compression_mask(seq_len, count, block, stride, q_ids, q_ids)[:, 0][:, :, None, None, :]
    p = jnp.where(mask & jnp.isfinite(lse), jnp.exp(s * jnp.asarray(scale, acc) - lse), jnp.zeros((), acc))
    overlap = jnp.asarray(nsa.overlap_matrix(seq_len, block, stride, select_block), acc)
    return jnp.einsum("bthi,ij->bthj", p.sum(3), overlap, precision=jax.lax.Precision.HIGHEST)


def selection_scores(importance, tokens, select_block: int):
    """The top-n rule's scores: `importance` [..., Ns] with +inf on the forced blocks and -inf beyond
    the causal frontier; `tokens` (int32) the query positions, of importance's rank, broadcasting
    against importance[..., :1]."""
    j = jnp.arange(importance.shape[-1], dtype=jnp.int32).reshape((1,) * (importance.ndim - 1) + (-1,))
    forced = functools.reduce(jnp.logical_or, (j == f for f in nsa.forced_blocks(tokens, select_block)))
    score = jnp.where(forced, jnp.inf, importance)
    return jnp.where(j <= tokens // select_block, score, -jnp.inf)


def top_n(importance, select_block: int, num_selected: int):
    """The top-n rule of `attn_spec.nsa` on imp [B, S, Hkv, Ns] -> int32 [B, S, Hkv, n]: blocks
    beyond the frontier out, the forced ones in, the rest by importance (larger first, ties to the
    lower index: `lax.top_k`'s order), ascending, -1 where no block fills a slot."""
    tokens = jnp.arange(importance.shape[1], dtype=jnp.int32)[None, :, None, None]
    values, idx = jax.lax.top_k(selection_scores(importance, tokens, select_block), num_selected)
    idx = jnp.where(values == -jnp.inf, jnp.iinfo(jnp.int32).max, idx.astype(jnp.int32))
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == jnp.iinfo(jnp.int32).max, -1, idx)
