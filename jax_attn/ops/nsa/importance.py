"""NSA block importance as a Pallas kernel (Triton lowering): the compression branch's
probabilities recomputed from (q, k_cmp, lse) and summed over each kv head's query heads, without
materialising the [B, S, Hq, Nc] scores (Yuan et al. 2025, Eq. 9-10; `attn_spec.nsa`), then the
top-n rule, one chunk of query tokens at a time (so not even [B, S, Hkv, Nc] exists at once).

One program per (tile of query tokens, batch, kv head): the tile's rows are its tokens x the
group's heads ([tokens * G, D], a free reshape of q's [tokens, G, D] block), so the dot is full
size for any group; it walks the compressed keys up to the last token's frontier in tiles,
p = exp2(scale' s - lse2) under the block-causal (and segment) mask, sums the G heads of every
token and writes the group's probability per compressed key, [B, Hkv, C, Nc] fp32 for a chunk of C
tokens. XLA then maps compressed keys to selection blocks (`branches.to_selection_blocks`) and
applies the top-n rule (`reference.top_n`) to the chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attn_spec import nsa
from attn_spec.tiles import pow2_at_least
from jax_attn.ops.common import padding
from jax_attn.ops.common.spec import LOG2E
from jax_attn.ops.nsa import branches, reference


def _tiles(interpret: bool, group: int):
    """(tokens per program, compressed keys per tile, num_warps, num_stages): 128 rows (16 in the
    interpreter), at least one token."""
    rows = 16 if interpret else 128
    return max(1, rows // group), 16 if interpret else 64, 4, 1 if interpret else 2


def _kernel(pos_ref, q_ref, kc_ref, lse_ref, *refs, block, stride, scale, precision, has_segments, width):
    if has_segments:
        q_seg_ref, kc_seg_ref, out_ref = refs
    else:
        (out_ref,) = refs
    tokens, group, head_dim = q_ref.shape
    rows = tokens * group
    q = q_ref[...].reshape(rows, head_dim)
    lse2 = lse_ref[...].reshape(rows) * LOG2E
    pos = jnp.broadcast_to(pos_ref[...][:, None], (tokens, group)).reshape(rows)
    finite = lse2 > -jnp.inf
    lse2 = jnp.where(finite, lse2, 0.0)
    if has_segments:
        q_seg = jnp.broadcast_to(q_seg_ref[...][:, None], (tokens, group)).reshape(rows)
    last = pos_ref[tokens - 1]  # the tile's last token sees the most compressed keys
    seen = jnp.maximum((last + 1 - block) // stride + 1, 0)
    visited = (seen + width - 1) // width
    total = kc_ref.shape[0] // width

    def visit(j, _):
        start = pl.multiple_of(j * width, width)
        kc = kc_ref[pl.ds(start, width), :]
        s = jax.lax.dot_general(q, kc, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        ends = (start + jnp.arange(width)) * stride + (block - 1)  # nsa.compressed_end
        mask = (ends[None, :] <= pos[:, None]) & finite[:, None]
        if has_segments:
            mask &= kc_seg_ref[pl.ds(start, width)][None, :] == q_seg[:, None]
        p = jnp.where(mask, jnp.exp2(s * (scale * LOG2E) - lse2[:, None]), 0.0)
        out_ref[:, pl.ds(start, width)] = p.reshape(tokens, group, width).sum(axis=1)
        return 0

    def clear(j, _):  # beyond the tile's frontier: nothing seen
        out_ref[:, pl.ds(pl.multiple_of(j * width, width), width)] = jnp.zeros((tokens, width), jnp.float32)
        return 0

    jax.lax.fori_loop(0, visited, visit, 0)
    jax.lax.fori_loop(visited, total, clear, 0)


def group_probabilities(q, k_cmp, lse, positions, *, block: int, stride: int, scale: float, precision,
                        q_ids=None, kc_ids=None, interpret: bool):
    """q [B, C, Hkv, G, D] (G a power of two, D padded), k_cmp [B, Nc', Hkv, D] (Nc' a multiple of
    the key tile), lse [B, Hkv, C, G] fp32, positions int32 [C] (ascending) -> [B, Hkv, C, Nc'] fp32:
    the sum over the group's heads of exp(scale q.k_cmp - lse) where visible. Segment ids: q_ids
    [B, C], kc_ids [B, Nc'] (an id no query has on blocks across segments)."""
    batch, chunk, kv_heads, group, head_dim = q.shape
    count = k_cmp.shape[1]
    tokens, width, num_warps, num_stages = _tiles(interpret, group)
    in_specs = [pl.BlockSpec((tokens,), lambda i, b, h: (i,)),
                pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, b, h: (b, i, h, 0, 0)),
                pl.BlockSpec((None, count, None, head_dim), lambda i, b, h: (b, 0, h, 0)),
                pl.BlockSpec((None, None, tokens, group), lambda i, b, h: (b, h, i, 0))]
    args = [positions, q, k_cmp, lse]
    if q_ids is not None:
        in_specs += [pl.BlockSpec((None, tokens), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, count), lambda i, b, h: (b, 0))]
        args += [q_ids, kc_ids]
    return pl.pallas_call(
        functools.partial(_kernel, block=block, stride=stride, scale=scale, precision=precision,
                          has_segments=q_ids is not None, width=width),
        grid=(chunk // tokens, batch, kv_heads),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, tokens, count), lambda i, b, h: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, chunk, count), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="nsa_importance",
    )(*args)


def select_pallas(q, k_cmp, lse, *, block: int, stride: int, select_block: int, num_selected: int, scale: float,
                  precision, q_ids=None, interpret: bool | None = None, max_bytes: int = 1 << 30):
    """The top-n blocks of every (token, kv head), int32 [B, S, Hkv, n] (`reference.top_n` of
    `reference.importance_reference`), one chunk of query tokens at a time: the group
    probabilities of a chunk ([B, Hkv, C, Nc] fp32, at most `max_bytes`) exist only inside it."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    batch, seq_len, num_heads, head_dim = q.shape
    count, kv_heads = k_cmp.shape[1], k_cmp.shape[2]
    num = nsa.selection_count(seq_len, select_block)
    if count == 0:
        imp = jnp.zeros((batch, seq_len, kv_heads, num), jnp.float32)
        return reference.top_n(imp, select_block, num_selected)
    group = num_heads // kv_heads
    group_pad, head_pad = pow2_at_least(group, 1), pow2_at_least(head_dim)
    tokens, width, _, _ = _tiles(interpret, group_pad)
    count_pad = pl.cdiv(count, width) * width
    chunk = max_bytes // (4 * batch * kv_heads * count_pad)
    chunk = max(tokens, min(1 << max(0, chunk.bit_length() - 1), pow2_at_least(seq_len, tokens)))
    chunks = pl.cdiv(seq_len, chunk)
    length = chunks * chunk

    qg = q.reshape(batch, seq_len, kv_heads, group, head_dim)
    qg = padding.pad_axis(padding.pad_axis(padding.pad_axis(qg, 3, group_pad), 4, head_pad), 1, length)
    kc = padding.pad_axis(padding.pad_axis(k_cmp, 3, head_pad), 1, count_pad)
    lg = lse.astype(jnp.float32).reshape(batch, kv_heads, group, seq_len).transpose(0, 1, 3, 2)
    lg = jnp.pad(lg, ((0, 0), (0, 0), (0, length - seq_len), (0, group_pad - group)), constant_values=-jnp.inf)
    ids = kc_ids = None
    if q_ids is not None:
        kc_ids, whole = reference.compressed_segment_ids(q_ids.astype(jnp.int32), block, stride)
        kc_ids = jnp.where(whole, kc_ids, q_ids.min().astype(jnp.int32) - 1)  # an id no query has
        kc_ids = padding.pad_axis(kc_ids, 1, count_pad, mode="edge")
        ids = padding.pad_axis(q_ids.astype(jnp.int32), 1, length, mode="edge")

    def one(c):
        first = c * chunk
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, first, chunk, axis)
        positions = first + jnp.arange(chunk, dtype=jnp.int32)
        p = group_probabilities(take(qg, 1), kc, take(lg, 2), positions, block=block, stride=stride, scale=scale,
                                precision=precision, q_ids=None if ids is None else take(ids, 1), kc_ids=kc_ids,
                                interpret=interpret)
        imp = branches.to_selection_blocks(p[..., :count], seq_len, block, stride, select_block)
        return reference.top_n(imp.transpose(0, 2, 1, 3), select_block, num_selected, first=first)

    picked = jax.lax.map(one, jnp.arange(chunks, dtype=jnp.int32))  # [chunks, B, C, Hkv, n]
    return picked.transpose(1, 0, 2, 3, 4).reshape(batch, length, kv_heads, num_selected)[:, :seq_len]
