"""NSA's compression branch and block importance at scale (the "triton" implementation's).

Compression attention on the flash engine. Query t sees compressed block i iff
`i * stride + block - 1 <= t` (`attn_spec.nsa.compressed_end`). Write t = m * stride + o (slot o of
row m): the condition is `i <= m - c_o` with `c_o = ceil((block - 1 - o) / stride)`, which is
`block / stride` for every slot but the last and one less for the last. So the queries of a slot
are plain causal attention over the compressed keys with a key offset: the slots go to the batch
axis (the compressed keys, 1/stride of the keys, are repeated there), two engine calls
(`flash_attention`, causal, kv_offset = c) cover every query, and the engine's backward gives the
gradients. The engine skips the tiles beyond each row's frontier, as for any causal call.

Importance for the top-n rule: the compression probabilities are recomputed from (q, k_cmp, lse)
one chunk of query tokens at a time (never [B, S, Hq, Nc] at once), summed over the group's heads
and mapped to selection blocks: where stride divides the selection block and the compression
block (powers of two: whenever stride <= select_block), selection block j overlaps compression
blocks [j r - b + 1, (j + 1) r - 1] (r = select_block / stride, b = block / stride), a reshape sum
plus b - 1 shifted slices, exact in any summation order that matters here; otherwise a product
with `nsa.overlap_matrix`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_spec import nsa
from jax_attn.ops.common import padding
from jax_attn.ops.nsa import reference


def compression_engine(q, k_cmp, v_cmp, *, block: int, stride: int, scale: float, q_ids=None, attention):
    """Block-causal attention over the compressed keys through `attention(q, k, v, kv_offset,
    segment_ids)` -> (out, lse) (the flash engine, causal) -> (out [B, S, Hq, D], lse [B, Hq, S])."""
    batch, seq_len, num_heads, head_dim = q.shape
    count = k_cmp.shape[1]
    if count == 0:  # no complete block: every row sees nothing
        return jnp.zeros_like(q), jnp.full((batch, num_heads, seq_len), -jnp.inf, jnp.float32)
    rows = -(-seq_len // stride)
    qs = padding.pad_axis(q, 1, rows * stride).reshape(batch, rows, stride, num_heads, head_dim)
    qs = qs.transpose(2, 0, 1, 3, 4)  # [stride, B, M, Hq, D]: slot o's queries t = m * stride + o
    if q_ids is not None:
        ids = padding.pad_axis(q_ids.astype(jnp.int32), 1, rows * stride, mode="edge")
        ids = ids.reshape(batch, rows, stride).transpose(2, 0, 1)
        kc_ids, whole = reference.compressed_segment_ids(q_ids.astype(jnp.int32), block, stride)
        kc_ids = jnp.where(whole, kc_ids, ids.min() - 1)  # a block across segments: an id no query has
    c = block // stride
    outs, lses = [], []
    for lo, hi, offset in ((0, stride - 1, c), (stride - 1, stride, c - 1)):
        n = hi - lo
        if n == 0:
            continue
        qg = qs[lo:hi].reshape(n * batch, rows, num_heads, head_dim)
        kg, vg = (jnp.broadcast_to(x[None], (n, *x.shape)).reshape(n * batch, *x.shape[1:]) for x in (k_cmp, v_cmp))
        seg = None if q_ids is None else (ids[lo:hi].reshape(n * batch, rows),
                                          jnp.broadcast_to(kc_ids[None], (n, *kc_ids.shape)).reshape(n * batch, count))
        out, lse = attention(qg, kg, vg, offset, seg)
        outs.append(out.reshape(n, batch, rows, num_heads, head_dim))
        lses.append(lse.reshape(n, batch, num_heads, rows))
    out = jnp.concatenate(outs, axis=0).transpose(1, 2, 0, 3, 4).reshape(batch, rows * stride, num_heads, head_dim)
    lse = jnp.concatenate(lses, axis=0).transpose(1, 2, 3, 0).reshape(batch, num_heads, rows * stride)
    return out[:, :seq_len], lse[:, :, :seq_len]


def _to_selection_blocks(p, seq_len: int, block: int, stride: int, select_block: int):
    """p [..., Nc] (per compression block) -> [..., Ns] (per selection block, summed over overlaps)."""
    count, num = p.shape[-1], nsa.selection_count(seq_len, select_block)
    if select_block % stride or block % stride:
        overlap = jnp.asarray(nsa.overlap_matrix(seq_len, block, stride, select_block), p.dtype)
        return jnp.einsum("...i,ij->...j", p, overlap, precision=jax.lax.Precision.HIGHEST)
    r, b = select_block // stride, block // stride
    lead = [(0, 0)] * (p.ndim - 1)
    # front: b - 1 zeros (blocks before 0); back: up to num * r entries
    padded = jnp.pad(p, lead + [(b - 1, max(0, num * r - count))])
    own = padded[..., b - 1:b - 1 + num * r].reshape(*p.shape[:-1], num, r).sum(-1)
    for shift in range(1, b):  # compression block j r - shift also overlaps selection block j
        own = own + padded[..., b - 1 - shift:b - 1 - shift + num * r:r]
    return own


def importance_chunked(q, k_cmp, lse, *, block: int, stride: int, select_block: int, scale: float, precision,
                       q_ids=None, max_elements: int = 1 << 26):
    """`reference.importance_reference`, one chunk of query tokens at a time (at most
    `max_elements` fp32 probabilities live at once) -> imp [B, S, Hkv, Ns] fp32."""
    batch, seq_len, num_heads, head_dim = q.shape
    count, kv_heads = k_cmp.shape[1], k_cmp.shape[2]
    group = num_heads // kv_heads
    num = nsa.selection_count(seq_len, select_block)
    if count == 0:
        return jnp.zeros((batch, seq_len, kv_heads, num), jnp.float32)
    chunk = int(max(1, min(seq_len, max_elements // max(1, batch * num_heads * count))))
    chunks = -(-seq_len // chunk)
    length = chunks * chunk
    qc = padding.pad_axis(q, 1, length).reshape(batch, chunks, chunk, kv_heads, group, head_dim)
    lc = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, length - seq_len)), constant_values=-jnp.inf)
    lc = lc.reshape(batch, kv_heads, group, chunks, chunk)
    ids = None
    if q_ids is not None:
        kc_ids, whole = reference.compressed_segment_ids(q_ids.astype(jnp.int32), block, stride)
        ids = padding.pad_axis(q_ids.astype(jnp.int32), 1, length, mode="edge").reshape(batch, chunks, chunk)
    ends = jnp.asarray(nsa.compressed_end(np.arange(count), block, stride), jnp.int32)

    def one(c):
        qi = qc[:, c]  # [B, C, Hkv, G, D]
        s = jnp.einsum("bthgd,bihd->bthgi", qi, k_cmp, precision=precision, preferred_element_type=jnp.float32)
        li = lc[:, :, :, c].transpose(0, 3, 1, 2)[..., None]  # [B, C, Hkv, G, 1]
        t = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (ends[None, :] <= t[:, None])[None, :, None, None, :]
        if ids is not None:
            seg = (ids[:, c][:, :, None] == kc_ids[:, None, :]) & whole[:, None, :]
            mask = mask & seg[:, :, None, None, :]
        mask = mask & jnp.isfinite(li)
        p = jnp.where(mask, jnp.exp(s * scale - jnp.where(mask, li, 0.0)), 0.0).sum(3)  # [B, C, Hkv, Nc]
        return _to_selection_blocks(p, seq_len, block, stride, select_block)

    imp = jax.lax.map(one, jnp.arange(chunks, dtype=jnp.int32))  # [chunks, B, C, Hkv, Ns]
    imp = imp.transpose(1, 0, 2, 3, 4).reshape(batch, length, kv_heads, num)
    return imp[:, :seq_len]
